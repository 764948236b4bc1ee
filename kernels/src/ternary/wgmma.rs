//! The W2A8 GEMM on Hopper's integer warpgroup MMA (`gemm.cu`, CUDA C++ after [`crate::hopper`]'s
//! header and integer wrappers and [`OUT_ELEMENT`]), launched through CubeCL's CUDA runtime ([`crate::cuda_source`]).
//!
//! It serves products of more rows than the GEMV takes on compute capability 9.0: the packed
//! weight is read at 2 bits a weight and expanded to bytes in shared memory, and the scales are
//! applied before the output is written, so a product is the activation kernel and this one.
//! The path it replaces there (the weight unpacked to an int8 temporary, cuBLASLt's i8 GEMM into
//! an i32 temporary, a rescale kernel) stays for other devices (`benches/RESULTS.md`,
//! thirty-third session, has both side by side).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::{MAX_K, PackedArgs, ROW_GRANULE};
use crate::cuda_source::{CudaSourceKernel, FloatKind, OUT_ELEMENT, fingerprint};
use crate::hopper::{COMMON, WGMMA_INT};

const SOURCE: &str = include_str!("gemm.cu");
const FINGERPRINT: u64 = fingerprint(&[COMMON, WGMMA_INT, OUT_ELEMENT, SOURCE]);

/// `gemm.cu`'s tile (`FEATS` weight rows by `TOKS` activation rows) and threads per cube.
const FEATS: usize = 128;
const TOKS: usize = 256;
const THREADS: u32 = 256;

/// `gemm.cu`'s `KILN_SHARED_BYTES`: five stages of a `[256, 128]` activation block and its
/// `[128, 32]` packed weight bytes, two `[64, 128]` byte tiles per warpgroup, the tile's scales and
/// code sums, the stages' mbarriers, and 1 KB to align the swizzled tiles.
const SHARED_BYTES: usize = 5 * (TOKS * 128 + FEATS * 32) + 2 * 2 * 64 * 128 + (2 * TOKS + FEATS) * 4 + 5 * 8 + 1024;

fn source(params: &[u32]) -> String {
    let [out] = params else { unreachable!("one gemm parameter") };
    format!("#define KILN_OUT_KIND {out}\n{COMMON}\n{WGMMA_INT}\n{OUT_ELEMENT}\n{SOURCE}")
}

/// Whether the kernel takes `m` activation rows against a `[n, k]` weight: `k` up to [`MAX_K`],
/// fewer than 2³¹ tiles, and not turned off by `KILN_TERNARY_WGMMA=0` (which measures the other
/// path against this one). The device must be compute capability 9.0 too (the source is `sm_90a`):
/// the caller checks that.
pub fn serves(m: usize, n: usize, k: usize) -> bool {
    fits(m, n, k) && crate::measurement_override("KILN_TERNARY_WGMMA", 0..=1) != Some(0)
}

/// The shape limits of [`serves`].
fn fits(m: usize, n: usize, k: usize) -> bool {
    m > 0 && n > 0 && (1..=MAX_K).contains(&k) && tiles(m, n) < i32::MAX as usize
}

/// Cubes of a launch: one per (activation tile, weight tile).
fn tiles(m: usize, n: usize) -> usize {
    m.div_ceil(TOKS) * n.div_ceil(FEATS)
}

/// Enqueues `out = (Σ c_w · q_x − Σ q_x) / (s_x · s_w)` for `m` activation rows (`args.x` in the
/// [`super::ActCodes::Tiled`] layout) against the packed `[n, k]` weight (`group` rows a scale),
/// output elements of `out_kind`, for a shape the kernel [`serves`].
pub fn launch_gemm(client: &ComputeClient<CudaRuntime>, out_kind: FloatKind, m: usize, n: usize, k: usize, group: usize, args: PackedArgs) {
    assert!(fits(m, n, k), "kiln ternary wgmma gemm: {m} rows against [{n}, {k}]");
    let kernel = CudaSourceKernel {
        entry: "kiln_ternary_gemm",
        key: (FINGERPRINT, vec![out_kind as u32]),
        cube_dim: CubeDim::new_1d(THREADS),
        shared_bytes: SHARED_BYTES,
        source,
    };
    let buffers = vec![args.x, args.x_scales, args.x_sums, args.words, args.w_scales, args.out];
    // `GemmParams`: rows, features, packed words a weight row, rows a scale.
    let params = [m, n, k.div_ceil(ROW_GRANULE) * ROW_GRANULE / super::CODES_PER_WORD, group].map(|v| v as u32);
    kernel.launch(client, CubeCount::Static(tiles(m, n) as u32, 1, 1), buffers, &params);
}
