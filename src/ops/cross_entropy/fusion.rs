//! Cross-entropy as custom operations of Burn's fusion stream.

use burn::tensor::{DType, Shape, TensorMetadata, ops::{FloatTensor, IntTensor}};
use burn_fusion::{Fusion, FusionBackend};

use super::CrossEntropyBackend;
use crate::backend::fusion::{FusedMixedOp, Operand, register_mixed};

type Mixed<B> = Operand<FloatTensor<B>, IntTensor<B>>;

#[derive(Clone, Debug)]
enum Op {
    Forward,
    Backward,
}

fn float<B: FusionBackend>(t: Option<Mixed<B>>) -> FloatTensor<B> {
    match t {
        Some(Operand::Float(t)) => t,
        _ => unreachable!("cross_entropy fusion op: a float operand expected"),
    }
}

fn int<B: FusionBackend>(t: Option<Mixed<B>>) -> IntTensor<B> {
    match t {
        Some(Operand::Int(t)) => t,
        _ => unreachable!("cross_entropy fusion op: an int operand expected"),
    }
}

impl<B: FusionBackend + CrossEntropyBackend> FusedMixedOp<B> for Op {
    fn run(&self, inputs: Vec<Mixed<B>>) -> Vec<Mixed<B>> {
        let mut inputs = inputs.into_iter();
        let (logits, targets) = (float::<B>(inputs.next()), int::<B>(inputs.next()));
        match self {
            Op::Forward => {
                let (loss, lse) = B::cross_entropy_forward(logits, targets);
                vec![Operand::Float(loss), Operand::Float(lse)]
            }
            Op::Backward => {
                let (lse, dloss) = (float::<B>(inputs.next()), float::<B>(inputs.next()));
                vec![Operand::Float(B::cross_entropy_backward(logits, targets, lse, dloss))]
            }
        }
    }
}

impl<B: FusionBackend + CrossEntropyBackend> CrossEntropyBackend for Fusion<B> {
    fn cross_entropy_forward(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let per_row = (Shape::new([logits.shape[0]]), DType::F32);
        let [loss, lse]: [_; 2] =
            register_mixed::<B, _>("kiln_cross_entropy_forward", vec![logits, targets], vec![per_row.clone(), per_row], Op::Forward).try_into().unwrap();
        (loss, lse)
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let out = (logits.shape(), logits.dtype);
        register_mixed::<B, _>("kiln_cross_entropy_backward", vec![logits, targets, lse, dloss], vec![out], Op::Backward).remove(0)
    }
}
