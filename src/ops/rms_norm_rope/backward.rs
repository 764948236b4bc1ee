//! The fused QK-norm + RoPE under `Autodiff`: one forward launch for q and k, then one graph node
//! per output (parents: the input and its γ) whose backward runs the fused backward kernel.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{backend::AutodiffBackend, ops::FloatTensor};

use super::{RmsNormRopeBackend, RmsNormRopeOutput};

#[derive(Debug)]
struct NormRopeGrad;

/// `(x, γ, rstd, cos, sin, offset)` of one of q or k.
type State<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, usize);

impl<B: RmsNormRopeBackend> Backward<B, 2> for NormRopeGrad {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, gamma, rstd, cos, sin, offset) = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let (dx, dgamma) = B::rms_norm_rope_backward(x, gamma, rstd, dy, cos, sin, offset);
        let [x_node, gamma_node] = ops.parents;
        if let Some(node) = x_node {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = gamma_node {
            grads.register::<B>(node.id, dgamma);
        }
    }
}

type AdTensor<B, C> = FloatTensor<Autodiff<B, C>>;

/// Attach the output of one of q or k to the graph.
fn track<B: RmsNormRopeBackend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    gamma: AdTensor<B, C>,
    out: FloatTensor<B>,
    state: impl FnOnce(FloatTensor<B>, FloatTensor<B>) -> State<B>,
) -> AdTensor<B, C> {
    match NormRopeGrad.prepare::<C>([x.node.clone(), gamma.node.clone()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state(x.primitive, gamma.primitive), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<B: RmsNormRopeBackend, C: CheckpointStrategy> RmsNormRopeBackend for Autodiff<B, C> {
    fn rms_norm_rope_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        q_gamma: FloatTensor<Self>,
        k_gamma: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
        epsilon: f64,
    ) -> RmsNormRopeOutput<Self> {
        let (cos, sin) = (cos.primitive, sin.primitive);
        let inner = B::rms_norm_rope_forward(
            q.primitive.clone(),
            k.primitive.clone(),
            q_gamma.primitive.clone(),
            k_gamma.primitive.clone(),
            cos.clone(),
            sin.clone(),
            offset,
            epsilon,
        );
        let (q_rstd, k_rstd) = (inner.q_rstd.clone(), inner.k_rstd.clone());
        let (c1, s1) = (cos.clone(), sin.clone());
        let q_out = track::<B, C>(q, q_gamma, inner.q, |x, g| (x, g, q_rstd, c1, s1, offset));
        let k_out = track::<B, C>(k, k_gamma, inner.k, |x, g| (x, g, k_rstd, cos, sin, offset));
        RmsNormRopeOutput {
            q: q_out,
            k: k_out,
            q_rstd: <Self as AutodiffBackend>::from_inner(inner.q_rstd),
            k_rstd: <Self as AutodiffBackend>::from_inner(inner.k_rstd),
        }
    }
}
