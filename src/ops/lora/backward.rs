//! LoRA under `Autodiff`: the node's parents are `x`, `base`, `A`, `B`; it keeps `x`, `h`, `A`
//! and `B` (`h`, the forward's `[rows, r]` product, is reused by `dB`), and its backward passes
//! `dy` on to the base unchanged. A gradient of `x` another consumer registered before (q/k/v and
//! gate/up projections share their input) becomes the `dx` product's residual instead of a
//! separate add, as in `ops::matmul`'s backward. The stand-alone dropout is a node of its own
//! whose backward is the same dropout (it is linear and its own adjoint), the mask rebuilt from
//! the seed.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{TensorMetadata, backend::AutodiffBackend, ops::FloatTensor};

use super::{DropoutMask, LoraBackend, LoraSpec};
use crate::ops::matmul::take_prior;

#[derive(Debug)]
struct LoraGrad;

#[derive(Debug, Clone)]
struct Saved<B: LoraBackend> {
    x: FloatTensor<B>,
    h: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    spec: LoraSpec,
}

impl<B: LoraBackend> Backward<B, 4> for LoraGrad {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let s = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let [x_node, base_node, a_node, b_node] = ops.parents;
        if x_node.is_some() || a_node.is_some() || b_node.is_some() {
            // `x`'s node on a throwaway tensor: how `take_prior` finds a registered gradient.
            let x_probe = x_node.map(|node| {
                let mut probe = <Autodiff<B> as AutodiffBackend>::from_inner(s.x.clone());
                probe.node = node;
                probe
            });
            let prior = x_probe.as_ref().and_then(|probe| take_prior::<B>(grads, probe, &s.x.shape(), s.x.dtype()));
            let g = B::lora_backward(s.x, s.h, s.a, s.b, dy.clone(), s.spec, prior);
            if let Some(probe) = x_probe {
                grads.register::<B>(probe.node.id, g.x);
            }
            for (node, grad) in [(a_node, g.a), (b_node, g.b)] {
                if let Some(node) = node {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
        if let Some(node) = base_node {
            grads.register::<B>(node.id, dy);
        }
    }
}

#[derive(Debug)]
struct DropoutGrad;

impl<B: LoraBackend> Backward<B, 1> for DropoutGrad {
    type State = DropoutMask;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [x_node] = ops.parents;
        if let Some(node) = x_node {
            grads.register::<B>(node.id, B::lora_dropout(dy, ops.state));
        }
    }
}

impl<B: LoraBackend, C: CheckpointStrategy> LoraBackend for Autodiff<B, C> {
    fn lora_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        let y = B::lora_dropout(x.primitive, mask);
        match DropoutGrad.prepare::<C>([x.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(mask, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn lora_forward(
        x: FloatTensor<Self>,
        base: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (y, h) = B::lora_forward(x.primitive.clone(), base.primitive, a.primitive.clone(), b.primitive.clone(), spec);
        let nodes = [x.node, base.node, a.node, b.node];
        let y = match LoraGrad.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(Saved { x: x.primitive, h: h.clone(), a: a.primitive, b: b.primitive, spec }, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        (y, Self::from_inner(h))
    }
}
