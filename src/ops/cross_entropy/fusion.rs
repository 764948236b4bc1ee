//! Cross-entropy as custom operations of Burn's fusion stream.

use burn::tensor::{DType, Shape, TensorMetadata, ops::{FloatTensor, IntTensor}};
use burn_fusion::{Fusion, FusionBackend};

use super::CrossEntropyBackend;
use crate::backend::fusion::{FusedMixedOp, Operand, register_mixed};

type Mixed<B> = Operand<FloatTensor<B>, IntTensor<B>>;

/// The op family named in the panics of a wrong operand.
const OP: &str = "cross_entropy";

#[derive(Clone, Debug)]
enum Op {
    Forward,
    Backward,
}

impl<B: FusionBackend + CrossEntropyBackend> FusedMixedOp<B> for Op {
    fn run(&self, inputs: Vec<Mixed<B>>) -> Vec<Mixed<B>> {
        let mut inputs = inputs.into_iter();
        let (logits, targets) = (Operand::float(inputs.next(), OP), Operand::int(inputs.next(), OP));
        match self {
            Op::Forward => {
                let (loss, lse) = B::cross_entropy_forward(logits, targets);
                vec![Operand::Float(loss), Operand::Float(lse)]
            }
            Op::Backward => {
                let (lse, dloss) = (Operand::float(inputs.next(), OP), Operand::float(inputs.next(), OP));
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
