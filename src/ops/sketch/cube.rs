//! Sketches on CubeCL backends: allocation around `kiln_kernels::sketch`.

use burn::tensor::{DType, FloatDType};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn::tensor::ops::FloatTensor;
use kiln_kernels::sketch::{launch_compress, launch_decompress};

use super::{Sketch, SketchBackend};
use crate::backend::cube::{dense, empty_like_device, storage};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> SketchBackend for CubeBackend<R, F, I, BT> {
    fn sketch_compress(g: FloatTensor<Self>, sketch: Sketch, squares: bool) -> FloatTensor<Self> {
        let g = dense(g);
        let c = empty_like_device(&g, [sketch.compressed()], DType::F32);
        launch_compress(&g.client.clone(), storage(&g), sketch.params(), squares, g.into_array_arg(), c.clone().into_array_arg());
        c
    }

    fn sketch_decompress(c: FloatTensor<Self>, sketch: Sketch, signed: bool, dtype: FloatDType) -> FloatTensor<Self> {
        let c = dense(c);
        let out = empty_like_device(&c, [sketch.n], dtype.into());
        launch_decompress(&c.client.clone(), storage(&out), sketch.params(), signed, c.into_array_arg(), out.clone().into_array_arg());
        out
    }
}
