//! Gated linear units from plain Burn tensor ops, f32 arithmetic.

use burn::tensor::{FloatDType, Tensor, TensorMetadata, activation, backend::Backend, ops::FloatTensor};

use super::GluActivation;
use crate::ops::{compute_dtype, prim, wrap};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_CUBIC: f64 = 0.044_715;

/// `(act(g), act'(g))` in f32 for a flattened tensor.
fn activation<B: Backend>(g: Tensor<B, 1>, act: GluActivation) -> (Tensor<B, 1>, Tensor<B, 1>) {
    match act {
        GluActivation::Silu => {
            let sig = activation::sigmoid(g.clone());
            let slope = sig.clone() * (g.clone() * (sig.clone().neg() + 1.0) + 1.0);
            (g * sig, slope)
        }
        GluActivation::GeluTanh => {
            let g2 = g.clone().square();
            let t = ((g.clone() + g2.clone() * g.clone() * GELU_CUBIC) * SQRT_2_OVER_PI).tanh();
            let value = g.clone() * (t.clone() + 1.0) * 0.5;
            let slope = (t.clone() + 1.0) * 0.5
                + g * (t.square().neg() + 1.0) * (g2 * (3.0 * GELU_CUBIC) + 1.0) * (0.5 * SQRT_2_OVER_PI);
            (value, slope)
        }
        GluActivation::Relu2 => {
            let r = g.clamp_min(0.0);
            (r.clone().square(), r * 2.0)
        }
    }
}

fn flat_f32<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    let work = compute_dtype(t.dtype());
    wrap::<B, 1>(B::float_reshape(t, [n].into())).cast(work)
}

fn back<B: Backend>(t: Tensor<B, 1>, like: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_reshape(prim(t.cast(FloatDType::from(like.dtype()))), like.shape())
}

pub fn forward<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>, act: GluActivation) -> FloatTensor<B> {
    let (value, _) = activation(flat_f32::<B>(gate), act);
    let out = value * flat_f32::<B>(up.clone());
    back(out, &up)
}

pub fn backward<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    dy: FloatTensor<B>,
    act: GluActivation,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (value, slope) = activation(flat_f32::<B>(gate.clone()), act);
    let dy = flat_f32::<B>(dy);
    let d_gate = dy.clone() * flat_f32::<B>(up.clone()) * slope;
    let d_up = dy * value;
    (back(d_gate, &gate), back(d_up, &up))
}
