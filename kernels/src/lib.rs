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
