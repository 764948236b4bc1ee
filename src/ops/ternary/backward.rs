//! Ternary products under `Autodiff`. A packed weight is frozen: [`ternary_matmul`]'s node has
//! one parent (the input). [`bitlinear`] trains a latent weight: its node has two parents and
//! passes gradients straight through both quantizers (BitNet's estimator): `dx = dy · W̃` with the
//! forward's quantized weight, `dW = dyᵀ · x̃` with the input's quantized activations, recomputed
//! from the saved input (one small kernel) rather than stored. [`bitlinear_normed`] has a third
//! parent, the input norm's `γ`: its backward recomputes the normalized rows inside that kernel
//! from `x` and the saved `rstd`, and passes `dy · W̃` on through the norm's backward.
//!
//! [`ternary_matmul`]: super::ternary_matmul
//! [`bitlinear`]: super::bitlinear
//! [`bitlinear_normed`]: super::bitlinear_normed

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    NodeId,
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{DType, backend::AutodiffBackend, ops::FloatTensor};

use super::{RowNorm, TernaryBackend, TernaryPrimitive};

/// The weight's parts on the inner backend (scales are never tracked).
fn inner<B: TernaryBackend, C: CheckpointStrategy>(weight: TernaryPrimitive<Autodiff<B, C>>) -> TernaryPrimitive<B> {
    weight.map(|i| i, Autodiff::<B, C>::inner)
}

#[derive(Debug)]
struct MatmulGrad;

impl<B: TernaryBackend> Backward<B, 1> for MatmulGrad {
    type State = TernaryPrimitive<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [x_node] = ops.parents;
        if let Some(node) = x_node {
            grads.register::<B>(node.id, B::ternary_input_grad(dy, ops.state));
        }
    }
}

#[derive(Debug)]
struct BitLinearGrad;

impl<B: TernaryBackend> Backward<B, 2> for BitLinearGrad {
    /// The input and the forward's quantized weight.
    type State = (FloatTensor<B>, TernaryPrimitive<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [x_node, w_node] = ops.parents;
        let (x, weight) = ops.state;
        if let Some(node) = w_node {
            grads.register::<B>(node.id, B::ternary_weight_grad(dy.clone(), x, None));
        }
        if let Some(node) = x_node {
            grads.register::<B>(node.id, B::ternary_input_grad(dy, weight));
        }
    }
}

/// The input, the norm (`γ`, `rstd`) and the forward's quantized weight.
type NormedState<B> = (FloatTensor<B>, RowNorm<FloatTensor<B>>, TernaryPrimitive<B>);

/// `dy · W̃` through the norm's backward: the gradients of `x` and `γ`, if either has a node.
fn through_norm<B: TernaryBackend>(dy: FloatTensor<B>, state: NormedState<B>, x_node: Option<NodeId>, gamma_node: Option<NodeId>, grads: &mut Gradients) {
    if x_node.is_none() && gamma_node.is_none() {
        return;
    }
    let (x, norm, weight) = state;
    let (dx, dgamma) = B::rms_norm_backward(x, norm.gamma, norm.rstd, B::ternary_input_grad(dy, weight));
    if let Some(id) = x_node {
        grads.register::<B>(id, dx);
    }
    if let Some(id) = gamma_node {
        grads.register::<B>(id, dgamma);
    }
}

/// [`super::ternary_matmul_normed`]: a frozen weight, gradients to `x` and `γ`.
#[derive(Debug)]
struct NormedMatmulGrad;

impl<B: TernaryBackend> Backward<B, 2> for NormedMatmulGrad {
    type State = NormedState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [x_node, gamma_node] = ops.parents;
        through_norm::<B>(dy, ops.state, x_node.map(|n| n.id), gamma_node.map(|n| n.id), grads);
    }
}

/// [`super::bitlinear_normed`]: gradients to `x`, `γ` and the latent weight.
#[derive(Debug)]
struct NormedBitLinearGrad;

impl<B: TernaryBackend> Backward<B, 3> for NormedBitLinearGrad {
    type State = NormedState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [x_node, gamma_node, w_node] = ops.parents;
        if let Some(node) = w_node {
            let (x, norm, _) = &ops.state;
            grads.register::<B>(node.id, B::ternary_weight_grad(dy.clone(), x.clone(), Some(norm.clone())));
        }
        through_norm::<B>(dy, ops.state, x_node.map(|n| n.id), gamma_node.map(|n| n.id), grads);
    }
}

impl<B: TernaryBackend, C: CheckpointStrategy> TernaryBackend for Autodiff<B, C> {
    fn ternary_quantize(weight: FloatTensor<Self>, group: usize) -> TernaryPrimitive<Self> {
        B::ternary_quantize(Self::inner(weight), group).map(|i| i, Self::from_inner)
    }

    fn ternary_dequantize(weight: TernaryPrimitive<Self>, dtype: DType) -> FloatTensor<Self> {
        Self::from_inner(B::ternary_dequantize(inner::<B, C>(weight), dtype))
    }

    fn ternary_quantize_acts(x: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (codes, scales) = B::ternary_quantize_acts(Self::inner(x));
        (Self::from_inner(codes), Self::from_inner(scales))
    }

    fn ternary_matmul(x: FloatTensor<Self>, weight: TernaryPrimitive<Self>) -> FloatTensor<Self> {
        let weight = inner::<B, C>(weight);
        let out = B::ternary_matmul(x.primitive.clone(), weight.clone());
        match MatmulGrad.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(weight, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn ternary_matmul_normed(x: FloatTensor<Self>, gamma: FloatTensor<Self>, epsilon: f64, weight: TernaryPrimitive<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let weight = inner::<B, C>(weight);
        let (out, rstd) = B::ternary_matmul_normed(x.primitive.clone(), gamma.primitive.clone(), epsilon, weight.clone());
        let out = match NormedMatmulGrad.prepare::<C>([x.node.clone(), gamma.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, RowNorm { gamma: gamma.primitive, rstd: rstd.clone() }, weight), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, Self::from_inner(rstd))
    }

    fn ternary_input_grad(dy: FloatTensor<Self>, weight: TernaryPrimitive<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::ternary_input_grad(Self::inner(dy), inner::<B, C>(weight)))
    }

    fn ternary_weight_grad(dy: FloatTensor<Self>, x: FloatTensor<Self>, norm: Option<RowNorm<FloatTensor<Self>>>) -> FloatTensor<Self> {
        Self::from_inner(B::ternary_weight_grad(Self::inner(dy), Self::inner(x), norm.map(|n| n.map(Self::inner))))
    }

    fn bitlinear(x: FloatTensor<Self>, weight: FloatTensor<Self>, group: usize) -> FloatTensor<Self> {
        let quantized = B::ternary_quantize(weight.primitive.clone(), group);
        let out = B::ternary_matmul(x.primitive.clone(), quantized.clone());
        match BitLinearGrad.prepare::<C>([x.node.clone(), weight.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, quantized), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn bitlinear_normed(x: FloatTensor<Self>, gamma: FloatTensor<Self>, epsilon: f64, weight: FloatTensor<Self>, group: usize) -> FloatTensor<Self> {
        let quantized = B::ternary_quantize(weight.primitive.clone(), group);
        let (out, rstd) = B::ternary_matmul_normed(x.primitive.clone(), gamma.primitive.clone(), epsilon, quantized.clone());
        match NormedBitLinearGrad.prepare::<C>([x.node.clone(), gamma.node.clone(), weight.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, RowNorm { gamma: gamma.primitive, rstd }, quantized), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}
