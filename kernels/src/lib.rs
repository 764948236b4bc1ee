//! Pure CubeCL kernels behind kiln. No Burn types appear here: every launch function takes a
//! `ComputeClient` and `TensorArg`s, so the same kernels serve any CubeCL runtime (CUDA, wgpu).
//!
//! One module per op, named after the op; `row` holds the launch geometry and the in-cube
//! reduction that the row-wise ops (RMSNorm, fused RMSNorm+RoPE) share.

pub mod flash_attention;
pub mod matmul;
pub mod rms_norm;
pub mod rms_norm_rope;
pub mod rope;
pub mod row;
pub mod stream_handshake;
pub mod swiglu;

pub use cubecl;

/// A count forced through environment variable `name` for measurements, if set to a number in
/// `valid`.
pub(crate) fn measurement_override(name: &str, valid: std::ops::RangeInclusive<usize>) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok()).filter(|n| valid.contains(n))
}
