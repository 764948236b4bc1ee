//! Sketches as custom operations of Burn's fusion stream.

use burn::tensor::{DType, FloatDType, Shape, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::{Sketch, SketchBackend};
use crate::backend::fusion::{FusedOp, register};

#[derive(Clone, Debug)]
enum Op {
    Compress { sketch: Sketch, squares: bool },
    Decompress { sketch: Sketch, signed: bool, dtype: FloatDType },
}

impl<B: FusionBackend + SketchBackend> FusedOp<B> for Op {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [x]: [_; 1] = inputs.try_into().unwrap();
        vec![match *self {
            Op::Compress { sketch, squares } => B::sketch_compress(x, sketch, squares),
            Op::Decompress { sketch, signed, dtype } => B::sketch_decompress(x, sketch, signed, dtype),
        }]
    }
}

impl<B: FusionBackend + SketchBackend> SketchBackend for Fusion<B> {
    fn sketch_compress(g: FloatTensor<Self>, sketch: Sketch, squares: bool) -> FloatTensor<Self> {
        let out = (Shape::new([sketch.compressed()]), DType::F32);
        register::<B, _>("kiln_sketch_compress", vec![g], vec![out], Op::Compress { sketch, squares }).remove(0)
    }

    fn sketch_decompress(c: FloatTensor<Self>, sketch: Sketch, signed: bool, dtype: FloatDType) -> FloatTensor<Self> {
        let out = (Shape::new([sketch.n]), dtype.into());
        register::<B, _>("kiln_sketch_decompress", vec![c], vec![out], Op::Decompress { sketch, signed, dtype }).remove(0)
    }
}
