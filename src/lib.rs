//! kiln: fused LLM kernels for Burn.
//!
//! - [`ops`]: the functional API (`rms_norm`, `rms_norm_residual`, `rope`, `rms_norm_rope`,
//!   `swiglu`, `geglu`) on `Tensor<B, D>` for any `B: KilnBackend`.
//! - [`backend`]: the backend extension traits, implemented for CubeCL backends (CUDA, wgpu) with
//!   kernels from `kiln-kernels`, for `Fusion<B>` (so `burn::backend::{Cuda, Wgpu}` work as they
//!   are), for `Autodiff<B, C>` with fused backward kernels, and for `NdArray` through the
//!   reference implementations that are also the tests' oracle.
//! - [`nn`]: Burn modules built on the ops.
//! - [`optim`]: optimizers built on the ops (AdamW with sketched moments).

pub mod backend;
mod error;
pub mod nn;
pub mod ops;
pub mod optim;

pub use backend::{KilnAutodiffBackend, KilnBackend};
