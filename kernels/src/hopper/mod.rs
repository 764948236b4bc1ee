//! CUDA C++ that kiln's Hopper kernels share (flash attention's `wgmma` kernels, the ternary and
//! NF4 GEMMs): `common.cuh` (addresses, `cp.async`, wgmma descriptors and synchronization) first,
//! then the warpgroup MMA wrappers a kernel uses, written out by `gen_wgmma.py`; the GEMMs' rule
//! for splitting a tile's reduction over a cluster ([`cluster_splits`]); and the grid and buffers
//! of a stream-K launch ([`stream_k_cubes`], [`stream_k_sync`]).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::{Binding, Handle};
use cubecl::stream_id::StreamId;

/// Addresses, copies, descriptors, wgmma synchronization and register fences.
pub const COMMON: &str = include_str!("common.cuh");
/// Float wrappers (`KILN_WGMMA_TYPE` "bf16" or "f16" defined before them).
pub const WGMMA: &str = include_str!("wgmma.cuh");
/// 8-bit integer wrappers (u8 × s8 → s32, both operands in shared memory).
pub const WGMMA_INT: &str = include_str!("wgmma_int.cuh");

/// Reduction blocks a cube takes at least when a tile's reduction is split.
pub const SPLIT_MIN_BLOCKS: usize = 8;

/// The most cubes that share a tile's reduction ([`cluster_splits`]).
pub const MAX_SPLITS: usize = 3;

/// Cubes (one cluster) that share the reduction of each of a launch's `tiles` tiles, `blocks`
/// blocks long: 3 up to a quarter as many tiles as SMs, 2 up to half, else 1, and each cube
/// [`SPLIT_MIN_BLOCKS`] or more. A launch of fewer tiles than half the SMs otherwise leaves SMs
/// idle for its whole run: the GEMM at 512 rows against `[4096, 11008]` (64 tiles) ran 1.47×
/// faster on two cubes a tile and 64 rows (32 tiles) 1.7× on three; the input gradient at 512 rows
/// of `[11008, 4096]` (64 tiles of 256 rows) 1.50× faster on two cubes a tile than on 128-row
/// tiles (thirty-seventh session). Cubes fill an SM each, and a cluster's must share a GPC: 32
/// tiles on four cubes each (128) ran 1.6× slower than on three (96), and 40 tiles on three (120,
/// launched after a whole wave of tiles) 1.2× slower than in that launch, unsplit; so three a tile
/// stops at a quarter of the SMs (`benches/RESULTS.md`, thirty-sixth session).
pub fn cluster_splits(tiles: usize, blocks: usize, sms: usize) -> usize {
    let fit = if 4 * tiles <= sms { MAX_SPLITS } else if 2 * tiles <= sms { 2 } else { 1 };
    fit.min(blocks / SPLIT_MIN_BLOCKS).max(1)
}

/// Cubes of a stream-K launch (`common.cuh`'s `StreamK`) on a device of `sms` SMs: one an SM,
/// within the sync buffer's 1023 flags ([`stream_k_sync`]).
pub fn stream_k_cubes(sms: usize) -> usize {
    sms.min(STREAM_K_SYNC_BYTES / 4 - 1)
}

/// Bytes of a stream-K sync buffer: the ticket counter and a flag for each of up to 1023 cubes.
const STREAM_K_SYNC_BYTES: usize = 4096;

/// The stream-K sync buffer of CUDA device `device` for the calling thread's CubeCL stream: zeroed
/// once, and left zero by every launch (`common.cuh`'s `StreamK`), so the launches queued on one
/// stream share it. One a stream, because launches on two streams may run at once; each is kept
/// for the process's life (4 KB a thread that launched one).
pub fn stream_k_sync(client: &ComputeClient<CudaRuntime>, device: usize) -> Binding {
    type Buffers = Mutex<HashMap<(usize, u64), Handle>>;
    static BUFFERS: OnceLock<Buffers> = OnceLock::new();
    let mut buffers = BUFFERS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let buffer = buffers.entry((device, StreamId::current().value)).or_insert_with(|| client.create_from_slice(&[0; STREAM_K_SYNC_BYTES]));
    buffer.clone().binding()
}
