//! LoRA under `Autodiff`: the node's parents are `x`, `base`, `A`, `B`; it keeps `x`, `h`, `A`
//! and `B` (`h`, the forward's `[rows, r]` product, is reused by `dB`), and its backward passes
//! `dy` on to the base unchanged. A LoRA layer over a float base ([`super::lora_linear`]) is one
//! node whose parents are `x`, `W`, the bias, `A`, `B`: its backward takes `dx` through the base
//! and the update at once, and the base's own gradients only where they are tracked (a frozen
//! base has none). Over a 4-bit base ([`super::lora_linear_4bit`]) the node keeps the packed
//! weight, not a float copy, and the weight is no parent. A gradient of `x` another consumer
//! registered before (q/k/v and gate/up projections share their input) becomes the `dx`
//! product's residual instead of a separate add, as in `ops::matmul`'s backward. The stand-alone dropout is a node of its own
//! whose backward is the same dropout (it is linear and its own adjoint), the mask rebuilt from
//! the seed.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{Shape, TensorMetadata, backend::AutodiffBackend, ops::FloatTensor};

use super::{DropoutMask, LoraBackend, LoraSpec};
use crate::ops::matmul::{GemmLayout, GemmViews, bias_grad, probe, take_prior};
use crate::ops::nf4::Quantized4Primitive;

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
            let x_probe = x_node.map(|node| probe!(B, node, &s.x));
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

/// The node of [`super::lora_linear`] and [`super::lora_linear_4bit`]: its parents are `x`, `W`
/// where it is a float tensor, the bias where there is one, `A` and `B` (`N` = 3 to 5).
#[derive(Debug)]
struct LinearGrad<const N: usize>;

/// A LoRA layer's base weight as its node keeps it: a float `[in, out]` tensor, or a 4-bit
/// `[out, in]` weight (frozen: no parent, no gradient), kept packed.
#[derive(Debug, Clone)]
enum BaseWeight<B: LoraBackend> {
    Float(FloatTensor<B>),
    Packed(Quantized4Primitive<B>),
}

impl<B: LoraBackend> BaseWeight<B> {
    /// `[in, out]`.
    fn dims(&self) -> [usize; 2] {
        match self {
            Self::Float(w) => w.shape().dims(),
            Self::Packed(w) => [w.layout.k, w.layout.n],
        }
    }
}

#[derive(Debug, Clone)]
struct LinearSaved<B: LoraBackend> {
    x: FloatTensor<B>,
    hs: FloatTensor<B>,
    w: BaseWeight<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    spec: LoraSpec,
    bias: bool,
}

impl<B: LoraBackend, const N: usize> Backward<B, N> for LinearGrad<N> {
    type State = LinearSaved<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let s = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        let mut parents = ops.parents.into_iter();
        let x_node = parents.next().flatten();
        let w_node = if matches!(s.w, BaseWeight::Float(_)) { parents.next().flatten() } else { None };
        let bias_node = if s.bias { parents.next().flatten() } else { None };
        let (a_node, b_node) = (parents.next().flatten(), parents.next().flatten());
        let (x_shape, [d_in, d_out]) = (s.x.shape(), s.w.dims());
        let rows = x_shape.num_elements() / d_in.max(1);
        if let Some(node) = w_node {
            // dW = xᵀ · dy, the base's full input (the dropout is the update's only).
            let views = GemmViews::new(Shape::new([1, rows, d_in]), Shape::new([1, rows, d_out]), Shape::new([d_in, d_out]), GemmLayout::new(true, false));
            grads.register::<B>(node.id, B::gemm(s.x.clone(), dy.clone(), None, None, views));
        }
        if let Some(node) = bias_node {
            grads.register::<B>(node.id, bias_grad::<B>(dy.clone(), rows, d_out));
        }
        if x_node.is_none() && a_node.is_none() && b_node.is_none() {
            return;
        }
        let x_probe = x_node.map(|node| probe!(B, node, &s.x));
        let prior = x_probe.as_ref().and_then(|probe| take_prior::<B>(grads, probe, &x_shape, s.x.dtype()));
        let want_dx = x_probe.is_some();
        let g = match s.w {
            BaseWeight::Float(w) => B::lora_linear_backward(s.x, s.hs, w, s.a, s.b, dy, s.spec, prior, want_dx),
            BaseWeight::Packed(w) => B::lora_linear_4bit_backward(s.x, s.hs, w, s.a, s.b, dy, s.spec, prior, want_dx),
        };
        if let (Some(probe), Some(dx)) = (x_probe, g.x) {
            grads.register::<B>(probe.node.id, dx);
        }
        for (node, grad) in [(a_node, g.a), (b_node, g.b)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
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

/// `$y` as the output of a [`LinearGrad`] node over `$nodes` (`$n` of them) that keeps `$saved`,
/// where any of them is tracked (`C`, the checkpoint strategy, from the caller's scope).
macro_rules! record_linear {
    ($n:literal, $nodes:expr, $saved:expr, $y:expr) => {
        match LinearGrad::<$n>.prepare::<C>($nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish($saved, $y),
            OpsKind::UnTracked(prep) => prep.finish($y),
        }
    };
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

    fn lora_linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let bias_inner = bias.as_ref().map(|t| t.primitive.clone());
        let (y, hs) = B::lora_linear_forward(x.primitive.clone(), w.primitive.clone(), bias_inner, a.primitive.clone(), b.primitive.clone(), spec);
        let saved = LinearSaved { x: x.primitive, hs: hs.clone(), w: BaseWeight::Float(w.primitive), a: a.primitive, b: b.primitive, spec, bias: bias.is_some() };
        let y = match bias {
            Some(bias) => record_linear!(5, [x.node, w.node, bias.node, a.node, b.node], saved, y),
            None => record_linear!(4, [x.node, w.node, a.node, b.node], saved, y),
        };
        (y, Self::from_inner(hs))
    }

    fn lora_linear_4bit_forward(
        x: FloatTensor<Self>,
        w: Quantized4Primitive<Self>,
        bias: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let w = w.map(|i| i, Self::inner);
        let bias_inner = bias.as_ref().map(|t| t.primitive.clone());
        let (y, hs) = B::lora_linear_4bit_forward(x.primitive.clone(), w.clone(), bias_inner, a.primitive.clone(), b.primitive.clone(), spec);
        let saved = LinearSaved { x: x.primitive, hs: hs.clone(), w: BaseWeight::Packed(w), a: a.primitive, b: b.primitive, spec, bias: bias.is_some() };
        let y = match bias {
            Some(bias) => record_linear!(4, [x.node, bias.node, a.node, b.node], saved, y),
            None => record_linear!(3, [x.node, a.node, b.node], saved, y),
        };
        (y, Self::from_inner(hs))
    }
}
