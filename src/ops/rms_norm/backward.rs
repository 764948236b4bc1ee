//! RMSNorm under `Autodiff`: one graph node for `y = rms_norm(h) · γ` whose backward calls the
//! inner backend's fused backward kernel, and, with a residual, one node for `h = x + residual`
//! that passes its gradient to both addends. Both come out of a single forward launch.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{backend::AutodiffBackend, ops::FloatTensor};

use super::{RmsNormBackend, RmsNormOutput};

#[derive(Debug)]
struct RmsNormGrad;

impl<B: RmsNormBackend> Backward<B, 2> for RmsNormGrad {
    /// `(h, γ, rstd)`.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (h, gamma, rstd) = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let (dh, dgamma) = B::rms_norm_backward(h, gamma, rstd, dy);
        let [h_node, gamma_node] = ops.parents;
        if let Some(node) = h_node {
            grads.register::<B>(node.id, dh);
        }
        if let Some(node) = gamma_node {
            grads.register::<B>(node.id, dgamma);
        }
    }
}

/// `h = x + residual`, computed inside the fused forward: the gradient of `h` goes to both.
#[derive(Debug)]
pub(crate) struct ResidualAdd;

impl<B: burn::tensor::backend::Backend> Backward<B, 2> for ResidualAdd {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [x_node, residual_node] = ops.parents;
        if let Some(node) = x_node {
            grads.register::<B>(node.id, grad.clone());
        }
        if let Some(node) = residual_node {
            grads.register::<B>(node.id, grad);
        }
    }
}

impl<B: RmsNormBackend, C: CheckpointStrategy> RmsNormBackend for Autodiff<B, C> {
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> RmsNormOutput<Self> {
        let inner = B::rms_norm_forward(
            x.primitive.clone(),
            gamma.primitive.clone(),
            residual.as_ref().map(|r| r.primitive.clone()),
            epsilon,
        );
        let has_residual = residual.is_some();
        let h = match (residual, inner.residual) {
            (Some(residual), Some(h)) => ResidualAdd
                .prepare::<C>([x.node.clone(), residual.node.clone()])
                .compute_bound()
                .stateless(h),
            _ => x,
        };
        let output = match RmsNormGrad
            .prepare::<C>([h.node.clone(), gamma.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (h.primitive.clone(), gamma.primitive, inner.rstd.clone()),
                inner.output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(inner.output),
        };
        RmsNormOutput {
            output,
            residual: has_residual.then_some(h),
            rstd: <Self as AutodiffBackend>::from_inner(inner.rstd),
        }
    }
}
