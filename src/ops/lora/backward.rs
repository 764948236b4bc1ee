//! LoRA under `Autodiff`. [`super::lora`]'s node has the parents `x`, `base`, `A`, `B`; it keeps
//! `x`, `h`, `A` and `B` (`h`, the forward's `[rows, r]` product, is reused by `dB`), and its
//! backward passes `dy` on to the base unchanged. [`super::lora_linear`]'s node over a frozen base
//! has the parents `x`, `A`, `B` and keeps the base's weight too: its backward adds the update's
//! share of `x`'s gradient in the base's input-gradient product. Both take a gradient of `x`
//! registered before them into a product's epilogue (`take_prior`) rather than a separate add.
//! The stand-alone dropout is a node of its own whose backward is the same dropout (it is linear
//! and its own adjoint), the mask rebuilt from the seed.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{TensorMetadata, backend::AutodiffBackend, ops::FloatTensor};

use super::{DropoutMask, LoraBackend, LoraGrads, LoraSpec, products};
use crate::ops::matmul::take_prior;

/// The node of [`super::lora`]: parents `x`, `A`, `B`, then the base where there is one
/// (`N` = 3 or 4).
#[derive(Debug)]
struct LoraGrad<const N: usize>;

#[derive(Debug, Clone)]
struct Saved<B: LoraBackend> {
    x: FloatTensor<B>,
    h: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    spec: LoraSpec,
}

/// `x`'s gradient registered before this node (for the products' epilogue) and a tensor carrying
/// `x`'s node to register the new one under; `(None, None)` when `x` needs no gradient.
macro_rules! x_prior {
    ($grads:expr, $node:expr, $x:expr) => {
        match $node {
            Some(node) => {
                let mut probe = <Autodiff<B> as AutodiffBackend>::from_inner($x.clone());
                probe.node = node;
                (take_prior::<B>($grads, &probe, &$x.shape(), $x.dtype()), Some(probe))
            }
            None => (None, None),
        }
    };
}

/// Register `A`'s and `B`'s gradients with the nodes that need them.
fn register_adapter<B: LoraBackend, N>(grads: &mut Gradients, nodes: [Option<N>; 2], g: &LoraGrads<FloatTensor<B>>, id: impl Fn(N) -> burn::backend::autodiff::NodeId) {
    for (node, grad) in nodes.into_iter().zip([&g.a, &g.b]) {
        if let Some(node) = node {
            grads.register::<B>(id(node), grad.clone());
        }
    }
}

impl<B: LoraBackend, const N: usize> Backward<B, N> for LoraGrad<N> {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let s = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let mut parents = ops.parents.into_iter();
        let [x_node, a_node, b_node] = [(); 3].map(|_| parents.next().flatten());
        let base_node = parents.next().flatten();
        if x_node.is_some() || a_node.is_some() || b_node.is_some() {
            let (prior, x_probe) = x_prior!(grads, x_node, s.x);
            let g = B::lora_backward(s.x, s.h, s.a, s.b, dy.clone(), s.spec, prior);
            if let Some(probe) = x_probe {
                grads.register::<B>(probe.node.id, g.x.clone());
            }
            register_adapter::<B, _>(grads, [a_node, b_node], &g, |n| n.id);
        }
        if let Some(node) = base_node {
            grads.register::<B>(node.id, dy);
        }
    }
}

#[derive(Debug)]
struct LoraLinearGrad;

impl<B: LoraBackend> Backward<B, 3> for LoraLinearGrad {
    /// The update's saved tensors and the frozen base weight.
    type State = (Saved<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (s, weight) = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let [x_node, a_node, b_node] = ops.parents;
        let (prior, x_probe) = x_prior!(grads, x_node, s.x);
        let g = B::lora_backward(s.x, s.h, s.a, s.b, dy.clone(), s.spec, prior);
        register_adapter::<B, _>(grads, [a_node, b_node], &g, |n| n.id);
        if let Some(probe) = x_probe {
            grads.register::<B>(probe.node.id, products::base_input_grad::<B>(dy, weight, g.x));
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

/// Record a node with its parents (burn-autodiff's node type is not nameable outside it).
macro_rules! record {
    ($grad:expr, $nodes:expr, $saved:expr, $out:expr) => {
        match $grad.prepare::<C>($nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish($saved, $out),
            OpsKind::UnTracked(prep) => prep.finish($out),
        }
    };
}

impl<B: LoraBackend, C: CheckpointStrategy> LoraBackend for Autodiff<B, C> {
    fn lora_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        let y = B::lora_dropout(x.primitive, mask);
        record!(DropoutGrad, [x.node], mask, y)
    }

    fn lora_forward(
        x: FloatTensor<Self>,
        base: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (y, h) = B::lora_forward(x.primitive.clone(), base.as_ref().map(|base| base.primitive.clone()), a.primitive.clone(), b.primitive.clone(), spec);
        let saved = Saved { x: x.primitive, h: h.clone(), a: a.primitive, b: b.primitive, spec };
        let (x, a, b) = (x.node, a.node, b.node);
        let y = match base {
            Some(base) => record!(LoraGrad::<4>, [x, a, b, base.node], saved, y),
            None => record!(LoraGrad::<3>, [x, a, b], saved, y),
        };
        (y, Self::from_inner(h))
    }

    fn lora_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> FloatTensor<Self> {
        let frozen = weight.node.requirement.is_none() && bias.as_ref().is_none_or(|bias| bias.node.requirement.is_none());
        if !frozen {
            // A base that trains: its product is a node of its own, the update one on its output.
            let base = products::base_product::<Self>(x.clone(), weight, bias, None);
            return Self::lora_forward(x, Some(base), a, b, spec).0;
        }
        let (update, h) = B::lora_forward(x.primitive.clone(), None, a.primitive.clone(), b.primitive.clone(), spec);
        let y = products::base_product::<B>(x.primitive.clone(), weight.primitive.clone(), bias.map(|bias| bias.primitive), Some(update));
        let saved = (Saved { x: x.primitive, h, a: a.primitive, b: b.primitive, spec }, weight.primitive);
        record!(LoraLinearGrad, [x.node, a.node, b.node], saved, y)
    }
}
