//! DoRA's rescaling under `Autodiff`: one node with parents `u` and `m` that keeps `u`, `m`, the
//! norm and the bias, and whose backward is the fused `(du, dm)` pass. The norm and the bias are
//! constants of the node, and the norm's own op takes no gradient: it runs on the inner backend.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{backend::AutodiffBackend, ops::FloatTensor};

use super::DoraBackend;
use crate::error::ensure;

#[derive(Debug)]
struct DoraGrad;

#[derive(Debug, Clone)]
struct Saved<B: DoraBackend> {
    u: FloatTensor<B>,
    magnitude: FloatTensor<B>,
    norm: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
}

impl<B: DoraBackend> Backward<B, 2> for DoraGrad {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let s = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let (du, dm) = B::dora_backward(s.u, s.magnitude, s.norm, s.bias, dy);
        let [u_node, m_node] = ops.parents;
        for (node, grad) in [(u_node, du), (m_node, dm)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: DoraBackend, C: CheckpointStrategy> DoraBackend for Autodiff<B, C> {
    fn dora_forward(u: FloatTensor<Self>, magnitude: FloatTensor<Self>, norm: FloatTensor<Self>, bias: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        ensure(bias.as_ref().is_none_or(|b| b.node.requirement.is_none()), "dora", || {
            "the bias is the frozen base layer's and takes no gradient here; freeze it (e.g. `Module::no_grad`)".to_string()
        });
        let (norm, bias) = (norm.primitive, bias.map(|b| b.primitive));
        let y = B::dora_forward(u.primitive.clone(), magnitude.primitive.clone(), norm.clone(), bias.clone());
        match DoraGrad.prepare::<C>([u.node, magnitude.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(Saved { u: u.primitive, magnitude: magnitude.primitive, norm, bias }, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn dora_norm(weight_norms_sq: FloatTensor<Self>, a_w: FloatTensor<Self>, a: FloatTensor<Self>, b: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        let [w_sq, a_w, a, b] = [weight_norms_sq, a_w, a, b].map(Self::inner);
        Self::from_inner(B::dora_norm(w_sq, a_w, a, b, scale))
    }
}
