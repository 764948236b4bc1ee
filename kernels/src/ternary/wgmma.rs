//! The W2A8 GEMM on Hopper's integer warpgroup MMA (`gemm.cu`, CUDA C++ after [`crate::hopper`]'s
//! header and integer wrappers and [`OUT_ELEMENT`]), and the packed weight's input gradient on
//! its float warpgroup MMA (`grad.cu`), launched through CubeCL's CUDA runtime
//! ([`crate::cuda_source`]).
//!
//! It serves products of more rows than the GEMV takes on compute capability 9.0: the packed
//! weight is read at 2 bits a weight and expanded to bytes in shared memory, and the scales are
//! applied before the output is written, so a product is the activation kernel and this one.
//! The path it replaces there (the weight unpacked to an int8 temporary, cuBLASLt's i8 GEMM into
//! an i32 temporary, a rescale kernel) stays for other devices (`benches/RESULTS.md`,
//! thirty-third session, has both side by side).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::{MAX_K, PackedArgs, weight_row_words};
use crate::cuda_source::{CudaSourceKernel, FloatKind, OUT_ELEMENT, fingerprint, swizzled_tile_map};
use crate::hopper::{COMMON, MAX_SPLITS, WGMMA, WGMMA_INT, cluster_splits, stream_k_cubes, stream_k_sync};

const SOURCE: &str = include_str!("gemm.cu");
const FINGERPRINT: u64 = fingerprint(&[COMMON, WGMMA_INT, OUT_ELEMENT, SOURCE]);
const GRAD_SOURCE: &str = include_str!("grad.cu");
const GRAD_FINGERPRINT: u64 = fingerprint(&[COMMON, WGMMA, OUT_ELEMENT, GRAD_SOURCE]);

/// `gemm.cu`'s tile (`FEATS` weight rows by `TOKS` activation rows) and threads per cube (a
/// warpgroup making the operands, two running the MMAs).
const FEATS: usize = 128;
const TOKS: usize = 256;
const THREADS: u32 = 384;

/// `gemm.cu`'s `KILN_SHARED_BYTES`: four stages of a `[256, 128]` activation block, eight slots of
/// a block's `[128, 32]` packed weight bytes, three slots of two `[64, 128]` byte tiles, the tile's
/// scales, their reciprocals and code sums, the stages' mbarriers, and 1 KB to align the swizzled
/// tiles.
const SHARED_BYTES: usize = 4 * TOKS * 128 + 8 * FEATS * 32 + 3 * 2 * 64 * 128 + (3 * TOKS + 2 * FEATS) * 4 + 4 * 8 + 1024;

fn source(params: &[u32]) -> String {
    let [out, splits] = params else { unreachable!("two gemm parameters") };
    format!("#define KILN_OUT_KIND {out}\n#define KILN_SPLITS {splits}\n{COMMON}\n{WGMMA_INT}\n{OUT_ELEMENT}\n{SOURCE}")
}

/// Whether the kernel takes `m` activation rows against a `[n, k]` weight: `k` up to [`MAX_K`],
/// fewer than 2³¹ cubes, and not turned off by `KILN_TERNARY_WGMMA=0` (which measures the other
/// path against this one). The device must be compute capability 9.0 too (the source is `sm_90a`):
/// the caller checks that.
pub fn serves(m: usize, n: usize, k: usize) -> bool {
    fits(m, n, k) && crate::measurement_override("KILN_TERNARY_WGMMA", 0..=1) != Some(0)
}

/// The shape limits of [`serves`].
fn fits(m: usize, n: usize, k: usize) -> bool {
    m > 0 && n > 0 && (1..=MAX_K).contains(&k) && MAX_SPLITS * tiles(m, n) < i32::MAX as usize
}

/// Tiles of a launch: one per (activation tile, weight tile).
fn tiles(m: usize, n: usize) -> usize {
    m.div_ceil(TOKS) * n.div_ceil(FEATS)
}

/// Blocks of a tile's reduction that stream-K must save each cube, against whole tiles in waves,
/// before it pays for its shared tiles' fixed costs (a helper's sums stored, an owner's gathered,
/// one more part's pipeline start: about 12 blocks' time). At 4096 rows against `[2048, 2048]`
/// (256 tiles of 16 blocks: 1.94 waves, a block saved) stream-K made the product 8–16% slower;
/// where it saves 14–44 blocks it ran 0–20% faster (fifty-fifth session).
const STREAM_K_MIN_SAVED_BLOCKS: usize = 12;

/// How the GEMM of `m` rows against `[n, k]` (k in blocks of 128 codes) spreads over the SMs:
/// `(cubes, splits)`. Fewer tiles than half the SMs split k over a cluster ([`cluster_splits`]);
/// more tiles than SMs take the stream-K schedule on one cube an SM ([`stream_k_cubes`]) where
/// that saves each cube [`STREAM_K_MIN_SAVED_BLOCKS`] of the last wave's idle blocks, unless
/// `KILN_TERNARY_STREAM_K=0` (for measurements); else one cube a tile. On the H200 against one cube
/// a tile (fifty-fifth session, GPU time a product): 2048 rows against `[2560, 6912]` 67.2 against
/// 84.4 µs, 512 rows against `[11008, 4096]` 49.6 against 54.6, against `[28672, 8192]` 181.5
/// against 196.7. Sharing the blocks of fewer tiles than SMs over all SMs ran slower than a cube a
/// tile (512 rows against `[6912, 2560]`: 28.6 against 21.2 µs) or a cluster split (`[4096,
/// 11008]`: 46.8 against 40.4).
fn grid(m: usize, n: usize, k: usize, sms: usize) -> (usize, usize) {
    let (tiles, blocks) = (tiles(m, n), weight_row_words(k).div_ceil(8));
    let splits = cluster_splits(tiles, blocks, sms);
    if splits > 1 {
        return (tiles * splits, splits);
    }
    let cubes = stream_k_cubes(sms);
    let saved = (tiles.div_ceil(cubes) * cubes - tiles) * blocks / cubes;
    let stream_k = tiles > cubes && saved >= STREAM_K_MIN_SAVED_BLOCKS && crate::measurement_override("KILN_TERNARY_STREAM_K", 0..=1) != Some(0);
    (if stream_k { cubes } else { tiles }, 1)
}

/// Bytes of the helpers' sums of a launch of `cubes` cubes over `tiles` tiles: a tile's 128 × 256
/// i32 sums a cube where the cubes share the last tiles' blocks, none where each takes whole tiles.
fn slot_bytes(tiles: usize, cubes: usize) -> usize {
    if tiles.is_multiple_of(cubes) { 0 } else { cubes * FEATS * TOKS * 4 }
}

/// Enqueues `out = (Σ c_w · q_x − Σ q_x) / (s_x · s_w)` for `m` activation rows (`args.x` in the
/// [`super::ActCodes::Tiled`] layout) against the packed `[n, k]` weight (`group` rows a scale),
/// output elements of `out_kind`, on CUDA device `device`, for a shape the kernel [`serves`].
#[allow(clippy::too_many_arguments)]
pub fn launch_gemm(client: &ComputeClient<CudaRuntime>, device: usize, out_kind: FloatKind, m: usize, n: usize, k: usize, group: usize, args: PackedArgs) {
    assert!(fits(m, n, k), "kiln ternary wgmma gemm: {m} rows against [{n}, {k}]");
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    let (cubes, splits) = grid(m, n, k, sms);
    let slots = if splits > 1 { 0 } else { slot_bytes(tiles(m, n), cubes) };
    let kernel = CudaSourceKernel {
        entry: "kiln_ternary_gemm",
        key: (FINGERPRINT, vec![out_kind as u32, splits as u32]),
        cube_dim: CubeDim::new_1d(THREADS),
        shared_bytes: SHARED_BYTES,
        source,
    };
    let sync = stream_k_sync(client, device);
    let slots = client.empty(slots.max(16)).binding();
    let buffers = vec![args.x, args.x_scales, args.x_sums, args.words, args.w_scales, args.out, sync, slots];
    // `GemmParams`: rows, features, packed words a weight row, rows a scale.
    let params = [m, n, weight_row_words(k), group].map(|v| v as u32);
    kernel.launch(client, CubeCount::Static(cubes as u32, 1, 1), buffers, &params);
}

/// `grad.cu`'s tile (`COLS` weight columns by `tokens` gradient rows), its dy box (`tokens` rows
/// by `BN` columns) and threads per cube (a warpgroup making the operands, two running the MMAs).
const GRAD_COLS: usize = 128;
const GRAD_BN: usize = 64;
const GRAD_THREADS: u32 = 384;

/// `grad.cu`'s `KILN_SHARED_BYTES` for cubes of `tokens` gradient rows: four stages of a
/// `[tokens, 64]` dy block, three slots of two `[64, 64]` value tiles, eight slots of a block's
/// `[64, 32]` packed weight bytes and the making threads' 128 scales, the stages' mbarriers, and
/// 1 KB to align the tiles.
const fn grad_shared_bytes(tokens: usize) -> usize {
    4 * tokens * GRAD_BN * 2 + 3 * 2 * GRAD_BN * 64 * 2 + 8 * (GRAD_BN * 32 + 128 * 4) + 4 * 8 + 1024
}

/// Gradient rows a cube takes: 256, or 128 where one tile of either covers `m` (less padding).
/// Where 256-row tiles leave most SMs idle the reduction is split instead ([`grad_splits`]): at
/// 512 rows of `[11008, 4096]` 128-row cubes ran 0.1176 ms, 256-row cubes two a tile 0.0783
/// (thirty-seventh session; the 34th's choice of 128-row cubes there predates the split).
fn grad_tokens(m: usize) -> usize {
    if m <= 128 { 128 } else { 256 }
}

/// [`cluster_splits`] of the input gradient of `dy [m, n]` against `[n, k]` (the reduction over
/// `n` in blocks of `BN`).
fn grad_splits(m: usize, n: usize, k: usize, sms: usize) -> usize {
    cluster_splits(grad_tiles(m, k, grad_tokens(m)), n.div_ceil(GRAD_BN), sms)
}

/// The buffers of [`launch_input_grad`]: the output gradient `[m, n]` (read through a tensor map
/// on it), the packed weight's words and scales, the input gradient `[m, k]`.
pub struct GradArgs {
    pub dy: cubecl::server::Binding,
    pub words: cubecl::server::Binding,
    pub w_scales: cubecl::server::Binding,
    pub dx: cubecl::server::Binding,
}

/// Whether the input-gradient kernel takes `dy [m, n]` against a `[n, k]` weight in `kind`: f16
/// or bf16, `n` a multiple of 8 (dy's rows a whole number of 16-byte units, as its tensor map
/// needs), indices within 32 bits, and not turned off by `KILN_TERNARY_GRAD_WGMMA=0` (which
/// measures the dequantize-and-cuBLASLt path against this one). As for [`serves`], the caller
/// checks the device (compute capability 9.0) and dy's 16-byte alignment.
pub fn grad_serves(kind: FloatKind, m: usize, n: usize, k: usize) -> bool {
    kind != FloatKind::F32
        && m > 0
        && n > 0
        && n.is_multiple_of(8)
        && (1..=MAX_K).contains(&k)
        && m.max(n) < i32::MAX as usize
        && MAX_SPLITS * grad_tiles(m, k, 128) < i32::MAX as usize
        && crate::measurement_override("KILN_TERNARY_GRAD_WGMMA", 0..=1) != Some(0)
}

/// Cubes of an input-gradient launch: one per (gradient tile, column tile).
fn grad_tiles(m: usize, k: usize, tokens: usize) -> usize {
    m.div_ceil(tokens) * k.div_ceil(GRAD_COLS)
}

fn grad_source(params: &[u32]) -> String {
    let [kind, tokens, splits] = params else { unreachable!("three grad parameters") };
    let wgmma = if *kind == FloatKind::F16 as u32 { "f16" } else { "bf16" };
    format!("#define KILN_OUT_KIND {kind}\n#define KILN_WGMMA_TYPE \"{wgmma}\"\n#define KILN_TOKS {tokens}\n#define KILN_SPLITS {splits}\n{COMMON}\n{WGMMA}\n{OUT_ELEMENT}\n{GRAD_SOURCE}")
}

/// `⌈2⁶⁴ / group⌉` for groups above 1 (0 for 1), which `grad.cu` divides row indices by.
fn group_magic(group: usize) -> u64 {
    if group <= 1 { 0 } else { ((1u128 << 64).div_ceil(group as u128)) as u64 }
}

/// Enqueues `dx [m, k] = dy [m, n] · (q / s)` for the packed `[n, k]` weight (`group` rows a
/// scale), dy and dx of `kind`, for a shape the kernel [`grad_serves`].
pub fn launch_input_grad(client: &ComputeClient<CudaRuntime>, kind: FloatKind, m: usize, n: usize, k: usize, group: usize, args: GradArgs) {
    assert!(grad_serves(kind, m, n, k), "kiln ternary wgmma input gradient: dy [{m}, {n}] ({kind:?}) against [{n}, {k}]");
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    let (tokens, splits) = (grad_tokens(m), grad_splits(m, n, k, sms));
    let kernel = CudaSourceKernel {
        entry: "kiln_ternary_input_grad",
        key: (GRAD_FINGERPRINT, vec![kind as u32, tokens as u32, splits as u32]),
        cube_dim: CubeDim::new_1d(GRAD_THREADS),
        shared_bytes: grad_shared_bytes(tokens),
        source: grad_source,
    };
    let map = swizzled_tile_map(args.dy, kind, [m, n], [tokens, GRAD_BN]);
    let magic = group_magic(group);
    // `GradParams`: rows, reduction, columns, packed words a weight row, rows a scale, the magic.
    let row_words = weight_row_words(k);
    let params = [m as u32, n as u32, k as u32, row_words as u32, group as u32, magic as u32, (magic >> 32) as u32];
    let cubes = CubeCount::Static((grad_tiles(m, k, tokens) * splits) as u32, 1, 1);
    // CubeCL passes the map's tensor (dy) right after the map, before these buffers.
    kernel.launch_with_maps(client, cubes, vec![map], vec![args.words, args.w_scales, args.dx], &params);
}

#[cfg(test)]
mod tests {
    use super::{grad_splits, grid, group_magic, slot_bytes};

    /// Tiles split k over a cluster while their clusters fit the SMs at once, each cube keeping 8
    /// or more blocks; more tiles than SMs take stream-K on one cube an SM where it saves 12 blocks
    /// a cube; else a cube a tile.
    #[test]
    fn grid_fits_the_sms() {
        let cases = [
            ((512, 4096, 11008), (128, 2)), // 64 tiles, 86 blocks
            ((512, 11008, 4096), (132, 1)), // 172 tiles: stream-K
            ((1024, 4096, 11008), (128, 1)), // 128 tiles
            ((2048, 2560, 6912), (132, 1)), // 160 tiles: stream-K
            ((4096, 2048, 2048), (256, 1)), // 256 tiles of 16 blocks: 1.94 waves
            ((4096, 8192, 2048), (1024, 1)), // 7.76 waves of 16 blocks: 3 blocks saved
            ((8192, 28672, 8192), (132, 1)), // 54.3 waves of 64 blocks
            ((512, 6912, 2560), (108, 1)),  // 108 tiles
            ((17, 1024, 4096), (24, 3)),    // 8 tiles, 32 blocks
            ((40, 700, 3000), (18, 3)),     // 6 tiles, 24 blocks
            ((300, 1001, 2600), (32, 2)),   // 16 tiles, 21 blocks
            ((9, 64, 1000), (1, 1)),        // 8 blocks
            ((512, 2560, 6912), (80, 2)),   // 40 tiles: three a tile would not fit
            ((256, 4224, 4096), (99, 3)),   // 33 tiles
        ];
        for ((m, n, k), want) in cases {
            assert_eq!(grid(m, n, k, 132), want, "{m} rows against [{n}, {k}]");
        }
        assert_eq!(slot_bytes(264, 132), 0);
        assert_eq!(slot_bytes(172, 132), 132 * 128 * 256 * 4);
    }

    /// The input gradient takes 256-row tiles (128 for at most 128 rows) and splits the reduction
    /// by the GEMM's rule.
    #[test]
    fn grad_splits_fill_one_wave() {
        let cases = [
            ((512, 11008, 4096), 2),  // 64 tiles, 172 blocks
            ((512, 4096, 11008), 1),  // 172 tiles
            ((1024, 11008, 4096), 1), // 128 tiles
            ((512, 28672, 8192), 1),  // 128 tiles
            ((100, 4096, 2048), 3),   // 16 tiles of 128 rows, 64 blocks
            ((17, 64, 200), 1),       // 2 tiles, one block
        ];
        for ((m, n, k), want) in cases {
            assert_eq!(grad_splits(m, n, k, 132), want, "dy [{m}, {n}] against [{n}, {k}]");
        }
    }

    /// `umul64hi(row, magic) = row / group` for every row below 2³² (checked at the edges).
    #[test]
    fn group_magic_divides_exactly() {
        for group in [2usize, 3, 7, 64, 1000, 4096, 28672, 128_256, (1 << 31) - 1, u32::MAX as usize] {
            let magic = group_magic(group) as u128;
            let rows = [0u64, 1, group as u64 - 1, group as u64, group as u64 + 1, 3 * group as u64 - 1, u32::MAX as u64 - 1, u32::MAX as u64];
            for row in rows.into_iter().filter(|&r| r <= u32::MAX as u64) {
                assert_eq!(((row as u128 * magic) >> 64) as u64, row / group as u64, "row {row} group {group}");
            }
        }
    }
}
