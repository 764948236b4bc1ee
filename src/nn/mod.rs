//! Burn modules built on kiln's fused ops.

mod attention;
mod item_memory;
mod linear;
mod lora_linear;
mod mlp;
mod nf4_linear;
mod rms_norm;

pub use attention::{KvCache, MultiHeadAttention, MultiHeadAttentionConfig};
pub use item_memory::{ItemMemory, Match};
pub use linear::{Linear, LinearConfig, LinearLayer};
pub use lora_linear::{LoraAdapter, LoraConfig, LoraLinear, seed_lora_dropout};
pub use mlp::{GatedMlp, GatedMlpConfig};
pub use nf4_linear::{NestedScales, Nf4Linear, Nf4LinearConfig, Nf4Memory};
pub use rms_norm::{RmsNorm, RmsNormConfig};
