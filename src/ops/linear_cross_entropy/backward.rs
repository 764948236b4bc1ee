//! The fused linear cross-entropy under `Autodiff`: the forward takes the gradients of the inputs
//! that need one (`chunks::run`), the node keeps them, and its backward scales them by the loss
//! gradient, a scalar.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{FloatDType, TensorMetadata, backend::Backend, ops::{FloatTensor, IntTensor}};

use super::chunks::{self, Wanted};
use super::{LinearCrossEntropyBackend, LinearCrossEntropyOptions};
use crate::ops::{prim, wrap};

#[derive(Debug)]
struct LinearCrossEntropyGrad;

impl<B: LinearCrossEntropyBackend> Backward<B, 2> for LinearCrossEntropyGrad {
    /// The gradients of `hidden` and `weight` for a loss gradient of 1.
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (dhidden, dweight) = ops.state;
        let dloss = grads.consume::<B>(&ops.node);
        let [hidden_node, weight_node] = ops.parents;
        for (node, grad) in [(hidden_node, dhidden), (weight_node, dweight)] {
            if let (Some(node), Some(grad)) = (node, grad) {
                grads.register::<B>(node.id, scaled::<B>(grad, dloss.clone()));
            }
        }
    }
}

/// `grad · dloss`, the scalar cast to the gradient's dtype.
fn scaled<B: Backend>(grad: FloatTensor<B>, dloss: FloatTensor<B>) -> FloatTensor<B> {
    let dtype = FloatDType::from(grad.dtype());
    prim(wrap::<B, 2>(grad) * wrap::<B, 1>(dloss).cast(dtype).reshape([1, 1]))
}

impl<B: LinearCrossEntropyBackend, C: CheckpointStrategy> LinearCrossEntropyBackend for Autodiff<B, C> {
    fn linear_cross_entropy(hidden: FloatTensor<Self>, weight: FloatTensor<Self>, targets: IntTensor<Self>, options: LinearCrossEntropyOptions) -> FloatTensor<Self> {
        let wanted = Wanted { hidden: !hidden.node.requirement.is_none(), weight: !weight.node.requirement.is_none() };
        match LinearCrossEntropyGrad.prepare::<C>([hidden.node, weight.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = chunks::run::<B>(hidden.primitive, weight.primitive, targets, options, wanted);
                prep.finish((out.hidden, out.weight), out.loss)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::linear_cross_entropy(hidden.primitive, weight.primitive, targets, options)),
        }
    }
}
