//! The backend extension: one trait per op family, implemented for CubeCL backends (kernels),
//! Fusion (custom stream operations), Autodiff (custom backward) and, through the reference
//! default methods, for any other backend.

pub(crate) mod cube;
pub(crate) mod fusion;
#[cfg(feature = "cuda")]
pub mod graph;

use crate::ops::{
    cross_entropy::CrossEntropyBackend, flash_attention::FlashAttentionBackend, matmul::MatmulBackend, rms_norm::RmsNormBackend, rms_norm_rope::RmsNormRopeBackend,
    linear_cross_entropy::LinearCrossEntropyBackend, lora::LoraBackend, nf4::Nf4Backend, rope::RopeBackend, sketch::SketchBackend, swiglu::SwiGluBackend, ternary::TernaryBackend, trit::TritBackend,
};

/// Every kiln op. Implemented for each backend that implements every op family.
pub trait KilnBackend:
    RmsNormBackend + RopeBackend + RmsNormRopeBackend + SwiGluBackend + FlashAttentionBackend + MatmulBackend + Nf4Backend + LoraBackend + TritBackend + SketchBackend + TernaryBackend + CrossEntropyBackend + LinearCrossEntropyBackend
{
}

impl<B> KilnBackend for B where
    B: RmsNormBackend + RopeBackend + RmsNormRopeBackend + SwiGluBackend + FlashAttentionBackend + MatmulBackend + Nf4Backend + LoraBackend + TritBackend + SketchBackend + TernaryBackend + CrossEntropyBackend + LinearCrossEntropyBackend
{
}

/// A kiln backend with autodiff whose inner backend is a kiln backend too (what training needs).
pub trait KilnAutodiffBackend: KilnBackend + burn::tensor::backend::AutodiffBackend<InnerBackend: KilnBackend> {}

impl<B> KilnAutodiffBackend for B where
    B: KilnBackend + burn::tensor::backend::AutodiffBackend<InnerBackend: KilnBackend>
{
}

/// Implement an op family for the backends that take its reference implementation (the trait's
/// default methods): NdArray here; other backends can do the same with an empty `impl`.
macro_rules! reference_backends {
    ($trait:path) => {
        #[cfg(feature = "ndarray")]
        impl<E: burn::backend::ndarray::FloatNdArrayElement, I: burn::backend::ndarray::IntNdArrayElement, Q: burn::backend::ndarray::QuantElement>
            $trait for burn::backend::ndarray::NdArray<E, I, Q>
        where
            burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<E>>,
            burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<I>>,
        {
        }
    };
}
pub(crate) use reference_backends;
