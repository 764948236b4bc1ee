//! CUDA C++ that kiln's Hopper kernels share (flash attention's `wgmma` kernels, the ternary
//! GEMM): `common.cuh` (addresses, `cp.async`, wgmma descriptors and synchronization) first, then
//! the warpgroup MMA wrappers a kernel uses, written out by `gen_wgmma.py`.

/// Addresses, copies, descriptors, wgmma synchronization and register fences.
pub const COMMON: &str = include_str!("common.cuh");
/// Float wrappers (`KILN_WGMMA_TYPE` "bf16" or "f16" defined before them).
pub const WGMMA: &str = include_str!("wgmma.cuh");
/// 8-bit integer wrappers (u8 × s8 → s32, both operands in shared memory).
pub const WGMMA_INT: &str = include_str!("wgmma_int.cuh");
