//! Sketches as custom operations of Burn's fusion stream.

use burn::tensor::{DType, FloatDType, Shape, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::{AdamWScalars, Sketch, SketchBackend};
use crate::backend::fusion::{FusedOp, register};

#[derive(Clone, Debug)]
enum Op {
    Compress { sketch: Sketch, squares: bool },
    Decompress { sketch: Sketch, signed: bool, dtype: FloatDType },
    AdamWStep { sketch: Sketch, scalars: AdamWScalars },
}

impl<B: FusionBackend + SketchBackend> FusedOp<B> for Op {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        match *self {
            Op::Compress { sketch, squares } => vec![B::sketch_compress(single(inputs), sketch, squares)],
            Op::Decompress { sketch, signed, dtype } => vec![B::sketch_decompress(single(inputs), sketch, signed, dtype)],
            Op::AdamWStep { sketch, scalars } => {
                let [param, grad, m, v]: [_; 4] = inputs.try_into().unwrap();
                B::sketch_adamw_step(param, grad, [m, v], sketch, scalars).into()
            }
        }
    }
}

fn single<T>(inputs: Vec<T>) -> T {
    let [x]: [_; 1] = inputs.try_into().ok().expect("one input");
    x
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

    fn sketch_adamw_step(param: FloatTensor<Self>, grad: FloatTensor<Self>, moments: [FloatTensor<Self>; 2], sketch: Sketch, scalars: AdamWScalars) -> [FloatTensor<Self>; 3] {
        let moment = (Shape::new([sketch.compressed()]), DType::F32);
        let outputs = vec![(param.shape.clone(), param.dtype), moment.clone(), moment];
        let [m, v] = moments;
        let out = register::<B, _>("kiln_sketch_adamw_step", vec![param, grad, m, v], outputs, Op::AdamWStep { sketch, scalars });
        out.try_into().ok().expect("three outputs")
    }
}
