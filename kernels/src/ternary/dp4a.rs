//! The W2A8 GEMV on CUDA (`gemv.cu`): the portable kernel's product with `__dp4a`, one
//! instruction per four codes, launched through CubeCL's CUDA runtime ([`crate::cuda_source`]).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Binding;

use super::{GEMV_MAX_ROWS, MAX_K, ROW_GRANULE};
use crate::cuda_source::{CudaSourceKernel, fingerprint};

const SOURCE: &str = include_str!("gemv.cu");
const FINGERPRINT: u64 = fingerprint(&[SOURCE]);
/// Threads per cube.
const CUBE_THREADS: usize = 256;

/// Output element type of the GEMV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutKind {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
}

/// Threads sharing a weight row and output features per thread for `rows` activation rows and
/// weight rows of `kv` 16-byte vectors: about two vectors per thread along the row, at most a
/// warp. Each activation load serves a thread's features, so more rows take more features (H100:
/// four features cut 8 rows at 8192 → 28672 from 140 to 102 µs; one row keeps two where `n`
/// leaves enough threads, `benches/RESULTS.md`).
fn tiling(rows: usize, n: usize, kv: usize) -> (usize, usize) {
    let threads = kv.div_ceil(2).next_power_of_two().clamp(4, 32);
    let threads = crate::measurement_override("KILN_TERNARY_GEMV_THREADS", 1..=32).filter(|t| t.is_power_of_two()).unwrap_or(threads);
    let features = match rows {
        1 if n < 4096 => 1,
        1 => 2,
        _ => 4,
    };
    (threads, crate::measurement_override("KILN_TERNARY_GEMV_FEATURES", 1..=8).unwrap_or(features))
}

fn source(params: &[u32]) -> String {
    let [rows, threads, features, out] = params else { unreachable!("four gemv parameters") };
    format!("#define KILN_ROWS {rows}\n#define KILN_T {threads}\n#define KILN_FPT {features}\n#define KILN_OUT_KIND {out}\n{SOURCE}")
}

/// The bindings of one product: packed activations `[rows, k]` with their f32 scales and code
/// sums, the packed weight `[n, k]` with its group scales, and the dense output `[rows, n]`.
pub struct GemvArgs {
    pub x: Binding,
    pub x_scales: Binding,
    pub x_sums: Binding,
    pub words: Binding,
    pub w_scales: Binding,
    pub out: Binding,
}

/// Enqueues `out = acc / (s_x · s_w)` on `client`'s stream.
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv(client: &ComputeClient<CudaRuntime>, out_kind: OutKind, rows: usize, n: usize, k: usize, group: usize, args: GemvArgs) {
    assert!((1..=GEMV_MAX_ROWS).contains(&rows) && k <= MAX_K && n < u32::MAX as usize, "kiln ternary dp4a gemv: {rows} rows, [{n}, {k}]");
    let kv = k.div_ceil(ROW_GRANULE);
    let (threads, features) = tiling(rows, n, kv);
    let params = [rows, threads, features, out_kind as usize].map(|p| p as u32);
    let kernel = CudaSourceKernel {
        entry: "kiln_ternary_gemv",
        key: (FINGERPRINT, params.to_vec()),
        cube_dim: CubeDim::new_1d(CUBE_THREADS as u32),
        shared_bytes: 0,
        source,
    };
    let slots = n.div_ceil(features);
    let cubes = CubeCount::Static((slots * threads).div_ceil(CUBE_THREADS) as u32, 1, 1);
    let buffers = vec![args.x, args.x_scales, args.x_sums, args.words, args.w_scales, args.out];
    kernel.launch(client, cubes, buffers, &[n as u32, kv as u32, group as u32]);
}
