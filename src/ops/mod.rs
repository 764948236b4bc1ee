//! The public functional API on `Tensor<B, D>` and, per op, its backend trait, reference
//! implementation, CubeCL implementation, fusion registration and autodiff backward.

pub mod cross_entropy;
pub mod dora;
pub mod flash_attention;
pub mod linear_cross_entropy;
pub mod lora;
pub mod matmul;
pub mod nf4;
pub mod rms_norm;
pub mod rms_norm_rope;
pub mod rope;
pub mod sketch;
pub mod swiglu;
pub mod ternary;
pub mod trit;

pub use cross_entropy::cross_entropy;
pub use dora::{dora, dora_norm};
pub use flash_attention::{AttentionOptions, flash_attention};
pub use linear_cross_entropy::linear_cross_entropy;
pub use lora::lora;
pub use matmul::{linear, linear_residual, matmul};
pub use nf4::matmul_4bit;
pub use rms_norm::{rms_norm, rms_norm_residual};
pub use rms_norm_rope::rms_norm_rope;
pub use rope::{RopeTable, rope};
pub use swiglu::{geglu, glu, relu2_glu, swiglu};
pub use ternary::{bitlinear, bitlinear_normed, ternary_matmul, ternary_matmul_normed};

use burn::tensor::{Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor};

/// Unwrap a float tensor into its backend primitive.
pub(crate) fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// Wrap a backend primitive of rank `D` into a tensor.
pub(crate) fn wrap<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Unwrap a float tensor into a primitive of the given (any-rank) shape.
pub(crate) fn prim_as<B: Backend, const D: usize>(t: Tensor<B, D>, shape: burn::tensor::Shape) -> FloatTensor<B> {
    B::float_reshape(prim(t), shape)
}

/// The dtype the references compute in: f64 stays f64 (the tests' oracle), everything else is
/// promoted to f32, as the kernels do.
pub(crate) fn compute_dtype(dtype: burn::tensor::DType) -> burn::tensor::FloatDType {
    match dtype {
        burn::tensor::DType::F64 => burn::tensor::FloatDType::F64,
        _ => burn::tensor::FloatDType::F32,
    }
}
