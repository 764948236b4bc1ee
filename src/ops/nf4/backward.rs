//! 4-bit products under `Autodiff`: the weight is frozen, so the product is a graph node with one
//! parent (the input) whose backward runs the input-gradient product on the same 4-bit weight.
//! The weight's float parts (scales, code books) are never tracked: they get no gradient and
//! hold no optimizer state.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{DType, backend::AutodiffBackend, ops::FloatTensor};

use super::{Nf4Backend, QuantType, Quantized4Primitive};

type Inner<B> = Quantized4Primitive<B>;

/// The weight's parts on the inner backend.
fn inner<B: Nf4Backend, C: CheckpointStrategy>(weight: Quantized4Primitive<Autodiff<B, C>>) -> Inner<B> {
    weight.map(|i| i, Autodiff::<B, C>::inner)
}

#[derive(Debug)]
struct MatmulGrad;

impl<B: Nf4Backend> Backward<B, 1> for MatmulGrad {
    type State = Inner<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [x_node] = ops.parents;
        if let Some(node) = x_node {
            grads.register::<B>(node.id, B::matmul_4bit_input_grad(dy, ops.state));
        }
    }
}

impl<B: Nf4Backend, C: CheckpointStrategy> Nf4Backend for Autodiff<B, C> {
    fn quantize_4bit(weight: FloatTensor<Self>, kind: QuantType, block: usize) -> Quantized4Primitive<Self> {
        B::quantize_4bit(Self::inner(weight), kind, block).map(|i| i, Self::from_inner)
    }

    fn dequantize_4bit(weight: Quantized4Primitive<Self>, dtype: DType) -> FloatTensor<Self> {
        Self::from_inner(B::dequantize_4bit(inner::<B, C>(weight), dtype))
    }

    fn matmul_4bit(x: FloatTensor<Self>, weight: Quantized4Primitive<Self>) -> FloatTensor<Self> {
        let weight = inner::<B, C>(weight);
        let out = B::matmul_4bit(x.primitive.clone(), weight.clone());
        match MatmulGrad.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(weight, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn matmul_4bit_input_grad(dy: FloatTensor<Self>, weight: Quantized4Primitive<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::matmul_4bit_input_grad(Self::inner(dy), inner::<B, C>(weight)))
    }
}
