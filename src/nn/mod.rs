//! Burn modules built on kiln's fused ops.

mod attention;
mod bit_linear;
mod item_memory;
mod linear;
mod lora_linear;
mod mlp;
mod nf4_linear;
mod rms_norm;

pub use attention::{KvCache, MultiHeadAttention, MultiHeadAttentionConfig};
pub use bit_linear::{BitLinear, BitLinearConfig, TernaryLinear};
pub use item_memory::{ItemMemory, Match};
pub use linear::{Linear, LinearConfig, LinearLayer};
pub use lora_linear::{LoraAdapter, LoraConfig, LoraLinear, seed_lora_dropout};
pub use mlp::{GatedMlp, GatedMlpConfig};
pub use nf4_linear::{NestedScales, Nf4Linear, Nf4LinearConfig, Nf4Memory};
pub use rms_norm::{RmsNorm, RmsNormConfig};

use burn::module::{Param, ParamId};
use burn::tensor::{Int, Tensor, backend::Backend};

/// A parameter that takes no gradient (frozen quantized layers' float parts).
pub(crate) fn frozen<B: Backend, const D: usize>(t: Tensor<B, D>) -> Param<Tensor<B, D>> {
    Param::from_tensor(t).set_require_grad(false)
}

/// An int parameter (packed words; ints never take gradients).
pub(crate) fn int_param<B: Backend>(t: Tensor<B, 1, Int>) -> Param<Tensor<B, 1, Int>> {
    Param::initialized(ParamId::new(), t)
}
