//! Gated linear units under `Autodiff`: the node keeps `gate` and `up` and its backward runs the
//! fused backward kernel, which recomputes the activation.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::ops::FloatTensor;

use super::{GluActivation, SwiGluBackend};

#[derive(Debug)]
struct GluGrad;

impl<B: SwiGluBackend> Backward<B, 2> for GluGrad {
    type State = (FloatTensor<B>, FloatTensor<B>, GluActivation);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (gate, up, act) = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let (d_gate, d_up) = B::glu_backward(gate, up, dy, act);
        let [gate_node, up_node] = ops.parents;
        if let Some(node) = gate_node {
            grads.register::<B>(node.id, d_gate);
        }
        if let Some(node) = up_node {
            grads.register::<B>(node.id, d_up);
        }
    }
}

impl<B: SwiGluBackend, C: CheckpointStrategy> SwiGluBackend for Autodiff<B, C> {
    fn glu_forward(gate: FloatTensor<Self>, up: FloatTensor<Self>, act: GluActivation) -> FloatTensor<Self> {
        let out = B::glu_forward(gate.primitive.clone(), up.primitive.clone(), act);
        match GluGrad.prepare::<C>([gate.node.clone(), up.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((gate.primitive, up.primitive, act), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}
