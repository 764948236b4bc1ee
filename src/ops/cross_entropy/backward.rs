//! Cross-entropy under `Autodiff`: the node keeps the logits, the targets and the per-row `lse`
//! (4 bytes a row), and its backward writes the logits' gradient in one pass.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{backend::AutodiffBackend, ops::{FloatTensor, IntTensor}};

use super::CrossEntropyBackend;

#[derive(Debug)]
struct CrossEntropyGrad;

impl<B: CrossEntropyBackend> Backward<B, 1> for CrossEntropyGrad {
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (logits, targets, lse) = ops.state;
        let dloss = grads.consume::<B>(&ops.node);
        let [logits_node] = ops.parents;
        if let Some(node) = logits_node {
            grads.register::<B>(node.id, B::cross_entropy_backward(logits, targets, lse, dloss));
        }
    }
}

impl<B: CrossEntropyBackend, C: CheckpointStrategy> CrossEntropyBackend for Autodiff<B, C> {
    fn cross_entropy_forward(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (loss, lse) = B::cross_entropy_forward(logits.primitive.clone(), targets.clone());
        let loss = match CrossEntropyGrad.prepare::<C>([logits.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((logits.primitive, targets, lse.clone()), loss),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        };
        (loss, <Self as AutodiffBackend>::from_inner(lse))
    }
}
