//! Pure CubeCL kernels behind kiln. No Burn types appear here: every launch function takes a
//! `ComputeClient` and `TensorArg`s, so the same kernels serve any CubeCL runtime (CUDA, wgpu).
//!
//! One module per op, named after the op; `row` holds the launch geometry and the in-cube
//! reduction that the row-wise ops (RMSNorm, fused RMSNorm+RoPE) share.
//!
//! Kernels that index their operands linearly (or with strides passed as scalars) bind them as
//! `Array`s, not `Tensor`s: for every `Tensor` binding CubeCL uploads its shape and strides before
//! the launch (on CUDA a staging copy, an allocation and a `cuMemcpyHtoDAsync` on the device
//! thread), which on the H100 held the host back behind the GPU and doubled the per-call time of
//! small products (`benches/RESULTS.md`, 2026-11-24 eleventh session).

#[cfg(feature = "cuda")]
pub mod cuda_source;
pub mod cross_entropy;
pub mod dora;
pub mod flash_attention;
#[cfg(feature = "cuda")]
pub mod hopper;
pub mod lora;
pub mod matmul;
pub mod nf4;
pub mod rms_norm;
pub mod rms_norm_rope;
pub mod rope;
pub mod row;
pub mod sketch;
pub mod stream_handshake;
pub mod swiglu;
pub mod ternary;
pub mod trit;

pub use cubecl;

/// A count forced through environment variable `name` for measurements, if set to a number in
/// `valid` (kiln's own switches use it too).
pub fn measurement_override(name: &str, valid: std::ops::RangeInclusive<usize>) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok()).filter(|n| valid.contains(n))
}
