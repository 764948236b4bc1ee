//! Ternary products under `Autodiff`. A packed weight is frozen: [`ternary_matmul`]'s node has
//! one parent (the input). [`bitlinear`] trains a latent weight: its node has two parents and
//! passes gradients straight through both quantizers (BitNet's estimator): `dx = dy · W̃` with the
//! forward's quantized weight, `dW = dyᵀ · x̃` with the input's quantized activations, recomputed
//! from the saved input (one small kernel) rather than stored.
//!
//! [`ternary_matmul`]: super::ternary_matmul
//! [`bitlinear`]: super::bitlinear

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{DType, backend::AutodiffBackend, ops::FloatTensor};

use super::{TernaryBackend, TernaryPrimitive};

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
            grads.register::<B>(node.id, B::ternary_weight_grad(dy.clone(), x));
        }
        if let Some(node) = x_node {
            grads.register::<B>(node.id, B::ternary_input_grad(dy, weight));
        }
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

    fn ternary_input_grad(dy: FloatTensor<Self>, weight: TernaryPrimitive<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::ternary_input_grad(Self::inner(dy), inner::<B, C>(weight)))
    }

    fn ternary_weight_grad(dy: FloatTensor<Self>, x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::ternary_weight_grad(Self::inner(dy), Self::inner(x)))
    }

    fn bitlinear(x: FloatTensor<Self>, weight: FloatTensor<Self>, group: usize) -> FloatTensor<Self> {
        let quantized = B::ternary_quantize(weight.primitive.clone(), group);
        let out = B::ternary_matmul(x.primitive.clone(), quantized.clone());
        match BitLinearGrad.prepare::<C>([x.node.clone(), weight.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, quantized), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}
