//! Burn modules built on kiln's fused ops.

mod mlp;
mod rms_norm;

pub use mlp::{GatedMlp, GatedMlpConfig};
pub use rms_norm::{RmsNorm, RmsNormConfig};
