//! The 4-bit GEMV on CUDA's tensor cores (`gemv.cu`): up to [`MMA_MAX_ROWS`] half-precision
//! activation rows against an NF4/FP4 weight, one table lookup per two weights and
//! `mma.sync.m16n8k16` for the multiply-adds. The portable kernel spends a lookup, a convert and
//! a fused multiply-add per weight and activation row, which held it near 1.2 TB/s on the H100
//! (`benches/RESULTS.md`, eighteenth session); here the rows ride in the MMA's N of 8 for free.
//! Launched through CubeCL's CUDA runtime ([`crate::cuda_source`]).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Binding;

use crate::cuda_source::{CudaSourceKernel, FloatKind, OUT_ELEMENT, fingerprint};

const SOURCE: &str = include_str!("gemv.cu");
const FINGERPRINT: u64 = fingerprint(&[OUT_ELEMENT, SOURCE]);
/// The most activation rows: the MMA's N.
pub const MMA_MAX_ROWS: usize = 8;
/// Elements of a row a warp takes at a time (one scale block or a part of one).
const SPAN: usize = 64;
/// Output features a warp computes: the MMA's M.
const TILE: usize = 16;
/// The table of byte → two half-precision codes, one copy per lane.
const TABLE_BYTES: usize = 256 * 32 * 4;
/// Warps resident per SM that the grid allows at most; shared memory often allows fewer (two
/// cubes of eight warps at the default tiling). The cubes resident set `__launch_bounds__`'
/// minimum, so the register budget follows them (128 a thread at two such cubes).
const WARPS_PER_SM: usize = 24;

/// Whether the tensor-core GEMV may run: `KILN_NF4_MMA=0` leaves products to the portable kernel
/// (to measure one against the other).
pub fn enabled() -> bool {
    crate::measurement_override("KILN_NF4_MMA", 0..=1) != Some(0)
}

/// Whether the kernel takes a product of `rows` rows with a `[n, k]` weight in blocks of
/// `block`: half-precision activations, whole spans, and blocks that are power-of-two spans
/// dividing the rows (no span straddles two scales, every row starts a block, and a span's block
/// is a shift away).
pub fn mma_fits(kind: FloatKind, rows: usize, n: usize, k: usize, block: usize) -> bool {
    kind != FloatKind::F32
        && (1..=MMA_MAX_ROWS).contains(&rows)
        && n > 0
        && n.div_ceil(TILE) <= u32::MAX as usize
        && k <= u32::MAX as usize
        && block.is_multiple_of(SPAN)
        && block.is_power_of_two()
        && k.is_multiple_of(block)
        && k > 0
}

/// The bindings of one product: activations `[rows, k]` (16-byte aligned), the packed codes,
/// the code book (16 f32), the block scales (plain absmax binds it in the nested slots too) and
/// the output `[rows, n]` in the activations' dtype.
pub struct MmaArgs {
    pub x: Binding,
    pub words: Binding,
    pub code: Binding,
    pub absmax: Binding,
    pub absmax_codes: Binding,
    pub nested_code: Binding,
    pub offset: Binding,
    pub out: Binding,
}

/// The kernel's tiling: warps a cube (they split `k` for one tile of features), spans a group
/// (one `cp.async` slot) and slots in a warp's ring. Eight warps with three slots of four spans
/// (2.5 KB each) leave room for two cubes an SM, the fastest of the tilings measured on the H100
/// (`benches/RESULTS.md`, thirty-first session); rows of fewer groups take fewer warps.
/// `KILN_NF4_MMA_WARPS`, `_UNROLL` and `_STAGES` override, for measurements.
fn tiling(spans: usize) -> (usize, usize, usize) {
    let unroll = crate::measurement_override("KILN_NF4_MMA_UNROLL", 2..=4).filter(|u| u % 2 == 0).unwrap_or(4);
    let useful = spans.div_ceil(unroll).next_power_of_two();
    let warps = crate::measurement_override("KILN_NF4_MMA_WARPS", 1..=16).filter(|w| w.is_power_of_two()).unwrap_or(useful.min(8));
    let stages = crate::measurement_override("KILN_NF4_MMA_STAGES", 2..=8).unwrap_or(3);
    (warps, unroll, stages)
}

/// Dynamic shared memory of a cube: the table, then a ring of `stages` slots per warp, each 16
/// rows of `unroll` spans (32 bytes each) plus 32 bytes of padding (`gemv.cu`).
fn shared_bytes(warps: usize, unroll: usize, stages: usize) -> usize {
    TABLE_BYTES + warps * stages * TILE * (32 * unroll + 32)
}

fn source(params: &[u32]) -> String {
    let [rows, kind, warps, nested, unroll, stages, min_blocks] = params else { unreachable!("seven nf4 mma parameters") };
    format!(
        "#define KILN_ROWS {rows}\n#define KILN_KIND {kind}\n#define KILN_OUT_KIND {kind}\n#define KILN_WARPS {warps}\n#define KILN_NESTED {nested}\n#define KILN_UNROLL {unroll}\n#define KILN_STAGES {stages}\n#define KILN_MIN_BLOCKS {min_blocks}\n{OUT_ELEMENT}\n{SOURCE}"
    )
}

/// Enqueues `out = x · Wᵀ` on `client`'s stream. The caller checks [`mma_fits`], a device of
/// compute capability 8.0 or up (bf16 MMA), and `x`'s alignment.
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv_mma(client: &ComputeClient<CudaRuntime>, kind: FloatKind, rows: usize, n: usize, k: usize, block: usize, nested: bool, args: MmaArgs) {
    assert!(mma_fits(kind, rows, n, k, block), "kiln nf4 mma gemv: {rows} rows of {kind:?}, [{n}, {k}] in blocks of {block}");
    let hardware = &client.properties().hardware;
    let sms = hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    let tiles = n.div_ceil(TILE);
    let (warps, unroll, stages) = tiling(k / SPAN);
    let shared = shared_bytes(warps, unroll, stages);
    // The static part: the warps' partial sums and, for nested scales, the code book.
    let fixed = warps * 4 * 32 * 4 + if nested { 256 * 4 } else { 0 };
    let resident = (WARPS_PER_SM / warps).min(hardware.max_shared_memory_size / (shared + fixed + 1024)).max(1);
    let params = [rows, kind as usize, warps, nested as usize, unroll, stages, resident].map(|p| p as u32);
    let kernel = CudaSourceKernel { entry: "kiln_nf4_gemv_mma", key: (FINGERPRINT, params.to_vec()), cube_dim: CubeDim::new_1d((32 * warps) as u32), shared_bytes: shared, source };
    let cubes = tiles.min(sms * resident);
    let MmaArgs { x, words, code, absmax, absmax_codes, nested_code, offset, out } = args;
    let buffers = vec![x, words, code, absmax, absmax_codes, nested_code, offset, out];
    // `gemv.cu`'s `Params`.
    let shape = [n, k, block, tiles].map(|v| v as u32);
    kernel.launch(client, CubeCount::Static(cubes as u32, 1, 1), buffers, &shape);
}
