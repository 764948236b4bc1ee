//! The 4-bit GEMM on Hopper's warpgroup MMA (`gemm.cu`, CUDA C++ after [`crate::hopper`]'s header
//! and float wrappers and [`OUT_ELEMENT`]): half-precision activations against an NF4/FP4 weight,
//! the weight's A operand made in registers from the packed codes (a scaled code book a row and
//! block, looked up by `prmt`), so the float weight is never written. Launched through CubeCL's
//! CUDA runtime ([`crate::cuda_source`]).
//!
//! It serves prefill-sized products on compute capability 9.0 up to [`MAX_ROWS`] rows, where it
//! beats dequantizing into a temporary and cuBLASLt's GEMM (`benches/RESULTS.md`, fifty-first
//! session); the input gradient (`dy · W`, the weight not transposed) stays on that path.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::mma::MmaArgs;
use crate::cuda_source::{CudaSourceKernel, FloatKind, OUT_ELEMENT, fingerprint, swizzled_tile_map};
use crate::hopper::{COMMON, MAX_SPLITS, SPLIT_MIN_BLOCKS, WGMMA, cluster_splits};

const SOURCE: &str = include_str!("gemm.cu");
const FINGERPRINT: u64 = fingerprint(&[COMMON, WGMMA, OUT_ELEMENT, SOURCE]);

/// `gemm.cu`'s tile (`FEATS` weight rows by `TOKS` activation rows), reduction block and threads
/// per cube (a warpgroup copying, two making their operands and running the MMAs).
const FEATS: usize = 128;
const TOKS: usize = 256;
const BK: usize = 64;
const THREADS: u32 = 384;

/// `gemm.cu`'s `KILN_SHARED_BYTES`: four stages of a `[256, 64]` activation block, three slots of
/// a block's 128 scaled code books (32 bytes each), eight slots of a block's packed rows and scale
/// parts, the stages' mbarriers, and 1 KB to align the swizzled tiles.
const SHARED_BYTES: usize = 4 * TOKS * BK * 2 + 3 * FEATS * 32 + 8 * (FEATS * BK / 2 + 2 * FEATS * 4) + 4 * 8 + 1024;

/// The most activation rows the kernel takes; more go to the dequantize-and-cuBLASLt path. On
/// the H200 the kernel's GPU time was 1.04–1.26× better than that path's at 1024 rows of the
/// Llama-7B shapes and 0.91–0.97× at 2048 (`benches/RESULTS.md`, fifty-first session).
pub const MAX_ROWS: usize = 1024;

/// Whether the kernel takes `m` rows of `kind` against a `[n, k]` weight in blocks of `block`:
/// f16 or bf16, up to [`MAX_ROWS`] rows, `k` a multiple of 64 (each row's run of 64 codes is 32
/// bytes under one scale, and x's rows are whole 16-byte units for its tensor map), blocks of 64 or
/// more, indices within 32 bits, and not turned off by `KILN_NF4_WGMMA=0` (which measures the
/// other path against this one). The caller checks the device (compute capability 9.0: the source
/// is `sm_90a`) and x's 16-byte alignment.
pub fn serves(kind: FloatKind, m: usize, n: usize, k: usize, block: usize) -> bool {
    kind != FloatKind::F32
        && (1..=MAX_ROWS).contains(&m)
        && n > 0
        && k > 0
        && k.is_multiple_of(BK)
        && block >= BK
        && block.is_power_of_two()
        && n.max(k) < i32::MAX as usize
        && MAX_SPLITS * tiles(m, n) < i32::MAX as usize
        && crate::measurement_override("KILN_NF4_WGMMA", 0..=1) != Some(0)
}

/// Tiles of a launch: one per (activation tile, weight tile).
fn tiles(m: usize, n: usize) -> usize {
    m.div_ceil(TOKS) * n.div_ceil(FEATS)
}

/// Cubes sharing a tile's reduction: [`cluster_splits`] of the launch's tiles over `k / 64`
/// blocks, or two where that rule keeps one but two cut the waves of cubes: 512 rows against
/// `[11008, 4096]` (172 tiles, two waves on 132 SMs; three on two cubes a tile, each half as long)
/// ran 0.0944 ms on two cubes a tile against 0.0999 on one and 0.1297 on three, and 1024 rows (344
/// tiles, no fewer waves) 0.150 ms on one against 0.186 on two; the ternary GEMM, whose rule
/// `cluster_splits` is, ran 512 rows against `[11008, 4096]` slower on two cubes a tile (0.0604
/// against 0.0541 ms) (fifty-first session).
/// `KILN_NF4_WGMMA_SPLITS` (1–3) overrides, for measurements.
fn splits(m: usize, n: usize, k: usize, sms: usize) -> usize {
    let (tiles, blocks) = (tiles(m, n), k / BK);
    let rule = cluster_splits(tiles, blocks, sms);
    let waves = |splits: usize| (tiles * splits).div_ceil(sms) as f64 / splits as f64;
    let chosen = if rule == 1 && blocks >= 2 * SPLIT_MIN_BLOCKS && waves(2) < waves(1) { 2 } else { rule };
    crate::measurement_override("KILN_NF4_WGMMA_SPLITS", 1..=MAX_SPLITS).unwrap_or(chosen)
}

fn source(params: &[u32]) -> String {
    let [kind, nested, splits] = params else { unreachable!("three nf4 gemm parameters") };
    let wgmma = if *kind == FloatKind::F16 as u32 { "f16" } else { "bf16" };
    format!(
        "#define KILN_OUT_KIND {kind}\n#define KILN_WGMMA_TYPE \"{wgmma}\"\n#define KILN_NESTED {nested}\n#define KILN_SPLITS {splits}\n{COMMON}\n{WGMMA}\n{OUT_ELEMENT}\n{SOURCE}"
    )
}

/// Enqueues `out = x · Wᵀ` for `m` rows of `kind` (`args.x` dense `[m, k]`) against the `[n, k]`
/// weight in blocks of `block`, for a shape the kernel [`serves`].
#[allow(clippy::too_many_arguments)]
pub fn launch_gemm(client: &ComputeClient<CudaRuntime>, kind: FloatKind, m: usize, n: usize, k: usize, block: usize, nested: bool, args: MmaArgs) {
    assert!(serves(kind, m, n, k, block), "kiln nf4 wgmma gemm: {m} rows of {kind:?} against [{n}, {k}] in blocks of {block}");
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    let splits = splits(m, n, k, sms);
    let kernel = CudaSourceKernel {
        entry: "kiln_nf4_gemm",
        key: (FINGERPRINT, vec![kind as u32, nested as u32, splits as u32]),
        cube_dim: CubeDim::new_1d(THREADS),
        shared_bytes: SHARED_BYTES,
        source,
    };
    let MmaArgs { x, words, code, absmax, absmax_codes, nested_code, offset, out } = args;
    let map = swizzled_tile_map(x, kind, [m, k], [TOKS, BK]);
    // `GemmParams`: rows, features, the reduction, log2(block).
    let params = [m as u32, n as u32, k as u32, block.trailing_zeros()];
    let cubes = CubeCount::Static((tiles(m, n) * splits) as u32, 1, 1);
    // CubeCL passes the map's tensor (x) right after the map, before these buffers.
    kernel.launch_with_maps(client, cubes, vec![map], vec![words, code, absmax, absmax_codes, nested_code, offset, out], &params);
}

#[cfg(test)]
mod tests {
    use super::{serves, splits};
    use crate::cuda_source::FloatKind;

    /// Half precision, whole 64-code runs under one scale, up to `MAX_ROWS` rows.
    #[test]
    fn serves_its_shapes_only() {
        let bf16 = FloatKind::Bf16;
        assert!(serves(bf16, 512, 4096, 4096, 64));
        assert!(serves(FloatKind::F16, 17, 1000, 2560, 4096));
        assert!(serves(bf16, super::MAX_ROWS, 11008, 4096, 128));
        assert!(!serves(FloatKind::F32, 512, 4096, 4096, 64));
        assert!(!serves(bf16, super::MAX_ROWS + 1, 4096, 4096, 64));
        assert!(!serves(bf16, 512, 4096, 4000, 64)); // k not a multiple of 64
        assert!(!serves(bf16, 512, 4096, 4096, 32)); // a run would straddle two scales
        assert!(!serves(bf16, 0, 4096, 4096, 64));
    }

    /// The launch's shared memory and the source's static code books fit Hopper's 227 KB a cube,
    /// and the source defines its parameters before the headers and names the entry point.
    #[test]
    fn source_fits_and_defines_its_parameters() {
        assert!(super::SHARED_BYTES + (16 + 256 + 1) * 4 <= 227 * 1024);
        let source = super::source(&[FloatKind::Bf16 as u32, 1, 2]);
        let at = |text: &str| source.find(text).unwrap_or_else(|| panic!("{text} is missing"));
        for define in ["KILN_OUT_KIND 2", "KILN_WGMMA_TYPE \"bf16\"", "KILN_NESTED 1", "KILN_SPLITS 2"] {
            assert!(at(define) < at("typedef unsigned int u32"), "{define}");
        }
        assert!(source.contains("kiln_nf4_gemm("));
    }

    /// Launches of fewer tiles than half the SMs split the reduction (the hopper rule), and so do
    /// launches whose waves two cubes a tile cut.
    #[test]
    fn splits_fill_the_waves() {
        assert_eq!(splits(512, 4096, 4096, 132), 2); // 64 tiles
        assert_eq!(splits(512, 4096, 11008, 132), 2);
        assert_eq!(splits(512, 11008, 4096, 132), 2); // 172 tiles: 2 waves, 1.5 on two cubes
        assert_eq!(splits(1024, 11008, 4096, 132), 1); // 344 tiles: 3 waves either way
        assert_eq!(splits(1024, 4096, 4096, 132), 1); // 128 tiles: one wave
        assert_eq!(splits(17, 1000, 2560, 132), 3); // 8 tiles, 40 blocks
        assert_eq!(splits(17, 64, 192, 132), 1); // 3 blocks
        assert_eq!(splits(1000, 11008, 960, 132), 1); // 15 blocks: too few to split
    }
}
