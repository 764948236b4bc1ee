//! Gated linear units: `swiglu(gate, up) = silu(gate) · up` (Llama/Qwen MLP),
//! `geglu(gate, up) = gelu_tanh(gate) · up` (Gemma MLP) and `relu2_glu(gate, up) = max(gate, 0)² · up`
//! (BitNet b1.58 MLP), each one pass forward and one backward.

mod backward;
mod cube;
mod fusion;
pub mod reference;

pub use kiln_kernels::swiglu::GluActivation;

use burn::tensor::{Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::{prim, wrap};
use crate::error::{ensure, ensure_float, ensure_same_dtype};

/// Backend support for gated linear units. The default methods are the reference.
pub trait SwiGluBackend: Backend {
    /// `act(gate) · up` for equally shaped inputs.
    fn glu_forward(gate: FloatTensor<Self>, up: FloatTensor<Self>, act: GluActivation) -> FloatTensor<Self> {
        reference::forward::<Self>(gate, up, act)
    }

    /// `(d_gate, d_up)` from the inputs and the output gradient (the activation is recomputed).
    fn glu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        act: GluActivation,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Self>(gate, up, dy, act)
    }
}

crate::backend::reference_backends!(SwiGluBackend);

/// `silu(gate) · up`, computed in f32, stored in the input dtype.
///
/// # Panics
/// If the shapes or dtypes of `gate` and `up` differ.
pub fn swiglu<B: SwiGluBackend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    glu(gate, up, GluActivation::Silu)
}

/// `gelu_tanh(gate) · up`, computed in f32, stored in the input dtype.
///
/// # Panics
/// If the shapes or dtypes of `gate` and `up` differ.
pub fn geglu<B: SwiGluBackend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    glu(gate, up, GluActivation::GeluTanh)
}

/// `max(gate, 0)² · up` (HF's `relu2`), computed in f32, stored in the input dtype.
///
/// # Panics
/// If the shapes or dtypes of `gate` and `up` differ.
pub fn relu2_glu<B: SwiGluBackend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    glu(gate, up, GluActivation::Relu2)
}

/// `act(gate) · up` with the activation chosen at run time (a model's config).
///
/// # Panics
/// If the shapes or dtypes of `gate` and `up` differ.
pub fn glu<B: SwiGluBackend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>, act: GluActivation) -> Tensor<B, D> {
    let op = act.op_name();
    let (gate, up) = (prim(gate), prim(up));
    ensure(gate.shape() == up.shape(), op, || {
        format!("gate {:?} and up {:?} must have the same shape", gate.shape().as_slice(), up.shape().as_slice())
    });
    ensure_float(op, "gate", gate.dtype());
    ensure_same_dtype(op, &[("gate", gate.dtype()), ("up", up.dtype())]);
    wrap(B::glu_forward(gate, up, act))
}
