//! Sketches on CubeCL backends: allocation around `kiln_kernels::sketch`.

use burn::tensor::{DType, FloatDType};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn::tensor::ops::FloatTensor;
use kiln_kernels::sketch::{AdamWArgs, launch_adamw_step, launch_compress, launch_decompress};

use super::{AdamWScalars, Sketch, SketchBackend};
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

    fn sketch_adamw_step(param: FloatTensor<Self>, grad: FloatTensor<Self>, moments: [FloatTensor<Self>; 2], sketch: Sketch, scalars: AdamWScalars) -> [FloatTensor<Self>; 3] {
        let (param, grad) = (dense(param), dense(grad));
        let [m, v] = moments.map(dense);
        let d = sketch.compressed();
        let out = empty_like_device(&param, [sketch.n], param.dtype);
        let [m_out, v_out] = [(); 2].map(|_| empty_like_device(&m, [d], DType::F32));
        let args = AdamWArgs {
            param: param.clone().into_array_arg(),
            grad: grad.into_array_arg(),
            moments: [m.into_array_arg(), v.into_array_arg()],
            param_out: out.clone().into_array_arg(),
            moments_out: [m_out.clone().into_array_arg(), v_out.clone().into_array_arg()],
            moments_read: [m_out.clone().into_array_arg(), v_out.clone().into_array_arg()],
        };
        launch_adamw_step(&param.client.clone(), storage(&param), sketch.params(), scalars, args);
        [out, m_out, v_out]
    }
}
