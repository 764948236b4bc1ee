//! The W2A8 GEMV on CUDA (`gemv.cu`): the portable kernel's product with `__dp4a`, one
//! instruction per four codes, or for two to eight rows on the integer tensor cores
//! (`mma.sync`), launched through CubeCL's CUDA runtime ([`crate::cuda_source`]).
//! [`launch_gemv_fused`] also quantizes the float activations in the same kernel, so a decoding
//! step's ternary linear is one launch instead of two.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Binding;

use super::{GEMV_MAX_ROWS, MAX_K, PackedArgs, ROW_GRANULE};
use crate::cuda_source::{CudaSourceKernel, FloatKind, OUT_ELEMENT, fingerprint};

const SOURCE: &str = include_str!("gemv.cu");
const FINGERPRINT: u64 = fingerprint(&[OUT_ELEMENT, SOURCE]);
/// Threads per cube of the two-kernel GEMV, and the cube the tiling rule fills on every SM.
const CUBE_THREADS: usize = 256;

/// Threads a cube of the fused GEMV for rows of `kv` 16-byte weight vectors (`4 · kv` quarters
/// of sixteen activations to quantize): every cube quantizes the whole row before its products,
/// one quarter a thread after another, each a dependent load, so a long row wants a larger cube.
/// One quarter a thread up to 256 threads, then up to two at 512, then 1024: on the H200 (probe,
/// same call) 512 threads took 8192 × 28672 from 30.8 to 25.1 µs and 1024 to 23.2, 2560 × 6912
/// from 7.0 to 6.2 and 4096 × 11008 from 8.5 to 7.8, while rows of 4096 or fewer codes lost
/// 0.3–2 µs with more than 256 (`benches/RESULTS.md`, thirty-fifth session).
fn fused_cube(kv: usize) -> usize {
    match 4 * kv {
        ..=256 => 256,
        257..=1024 => 512,
        _ => 1024,
    }
}

/// Threads sharing a weight row and output features per thread for `rows` activation rows against
/// `n` weight rows of `kv` 16-byte vectors, on a device of `sms` multiprocessors (4 to 32 threads
/// a row). One row: about four vectors a thread (the power of two at or below `kv / 4`) and two
/// features a thread, unless that leaves fewer threads than one full cube on every multiprocessor:
/// then one feature, then twice the threads, until it does not. Against the older rule (about two
/// vectors a thread; one feature below 4096 features) on the H100, same call: 13824 × 2560 went
/// from 9.0–9.6 to 6.6–7.7 µs and 28672 × 8192 from 28.8–29.3 to 28.2–28.6; the other BitNet and
/// Llama shapes moved within the calls' noise. Without the threads floor 2560 × 2560 ran 40
/// cubes and lost a third (`benches/RESULTS.md`, thirty-second session). More rows (on devices
/// without the integer MMA, or with `KILN_TERNARY_GEMV_MMA=0`) keep about two vectors a thread
/// and take four features, so one activation load serves more weight rows (8 rows at 8192 →
/// 28672: 140 → 102 µs).
fn tiling(rows: usize, n: usize, kv: usize, sms: usize) -> (usize, usize) {
    let (mut threads, mut features) = match rows {
        1 => (prev_power_of_two(kv / 4).clamp(4, 32), 2),
        _ => (kv.div_ceil(2).next_power_of_two().clamp(4, 32), 4),
    };
    while rows == 1 && n.div_ceil(features) * threads < sms * CUBE_THREADS && (features > 1 || threads < 32) {
        if features > 1 {
            features = 1;
        } else {
            threads *= 2;
        }
    }
    let threads = crate::measurement_override("KILN_TERNARY_GEMV_THREADS", 1..=32).filter(|t| t.is_power_of_two()).unwrap_or(threads);
    (threads, crate::measurement_override("KILN_TERNARY_GEMV_FEATURES", 1..=8).unwrap_or(features))
}

/// The largest power of two at or below `v` (1 for 0).
fn prev_power_of_two(v: usize) -> usize {
    if v == 0 { 1 } else { 1 << v.ilog2() }
}

fn source(params: &[u32]) -> String {
    let [rows, threads, features, out, input, cube] = params else { unreachable!("six gemv parameters") };
    format!(
        "#define KILN_ROWS {rows}\n#define KILN_T {threads}\n#define KILN_FPT {features}\n#define KILN_OUT_KIND {out}\n#define KILN_IN_KIND {input}\n#define KILN_CUBE {cube}\n{OUT_ELEMENT}\n{SOURCE}"
    )
}

/// The `dp4a` tiling (threads a row, features a thread) for `rows` activation rows against
/// `[n, k]` on `client`'s device, after checking the shape the kernels take.
fn device_tiling(client: &ComputeClient<CudaRuntime>, rows: usize, n: usize, k: usize) -> (usize, usize) {
    check(rows, n, k);
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    tiling(rows, n, k.div_ceil(ROW_GRANULE), sms)
}

/// Panics on a shape the kernels do not take: 1 to 8 rows, `k` within exact integer sums, `n`
/// within u32.
fn check(rows: usize, n: usize, k: usize) {
    assert!((1..=GEMV_MAX_ROWS).contains(&rows) && k <= MAX_K && n < u32::MAX as usize, "kiln ternary dp4a gemv: {rows} rows, [{n}, {k}]");
}

/// The compiled variant of `entry` for `rows` activation rows, the `dp4a` tiling `(threads,
/// features)`, the element `kinds` and cubes of `cube` threads.
fn kernel(entry: &'static str, rows: usize, (threads, features): (usize, usize), kinds: [FloatKind; 2], cube: usize, shared_bytes: usize) -> CudaSourceKernel {
    let params = [rows, threads, features, kinds[0] as usize, kinds[1] as usize, cube].map(|p| p as u32);
    CudaSourceKernel { entry, key: (FINGERPRINT, params.to_vec()), cube_dim: CubeDim::new_1d(cube as u32), shared_bytes, source }
}

/// The tiling the MMA entry compiles with: it reads none, but the source defines one for the
/// file's other entries, and a fixed one lets every shape share a compilation.
const MMA_TILING: (usize, usize) = (32, 1);

/// Enqueues `out = acc / (s_x · s_w)` on `client`'s stream. With `mma` (a device of compute
/// capability 8.0 or up), two to eight rows take the integer tensor-core kernel, one cube of
/// eight warps splitting `k` for each 16 weight rows; otherwise the `dp4a` kernel. On the H100
/// the MMA kernel took 8 rows of 28672 × 8192 from 88–89 to 26–32 µs and 4 rows from 46–49 to
/// 33–34 (`benches/RESULTS.md`, thirty-fifth session); `KILN_TERNARY_GEMV_MMA=0` measures the
/// `dp4a` kernel instead.
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv(client: &ComputeClient<CudaRuntime>, out_kind: FloatKind, rows: usize, n: usize, k: usize, group: usize, mma: bool, args: PackedArgs) {
    let buffers = vec![args.x, args.x_scales, args.x_sums, args.words, args.w_scales, args.out];
    if mma && rows > 1 && crate::measurement_override("KILN_TERNARY_GEMV_MMA", 0..=1) != Some(0) {
        check(rows, n, k);
        let kernel = kernel("kiln_ternary_gemv_mma", rows, MMA_TILING, [out_kind, FloatKind::F32], CUBE_THREADS, 0);
        kernel.launch(client, CubeCount::Static(n.div_ceil(16) as u32, 1, 1), buffers, &shape_params(n, k, group));
        return;
    }
    let (threads, features) = device_tiling(client, rows, n, k);
    let kernel = kernel("kiln_ternary_gemv", rows, (threads, features), [out_kind, FloatKind::F32], CUBE_THREADS, 0);
    let cubes = CubeCount::Static((n.div_ceil(features) * threads).div_ceil(CUBE_THREADS) as u32, 1, 1);
    kernel.launch(client, cubes, buffers, &shape_params(n, k, group));
}

/// `gemv.cu`'s `Params`: output features, 16-byte weight vectors a row, output rows a scale.
fn shape_params(n: usize, k: usize, group: usize) -> [u32; 3] {
    [n as u32, k.div_ceil(ROW_GRANULE) as u32, group as u32]
}

/// The most shared memory the fused GEMV gives its activation codes (`rows · padded k` bytes):
/// at this size two cubes still fit an H100 SM. Longer rows take the two-kernel path.
pub const FUSED_MAX_SHARED: usize = 96 * 1024;
/// The most activation rows the fused GEMV takes. Each cube quantizes every row before its first
/// product and then reads all rows' codes from shared memory for each weight vector. On the H200
/// one row gains 1.0–2.3× device time over the two-kernel path at every shape measured, while 4
/// rows lose up to 1.3× (20480 × 3200: 32 against 25 µs) and 8 rows up to 1.6× (28672 × 8192:
/// 142 against 96 µs) (`benches/RESULTS.md`, twenty-fifth session).
pub const FUSED_MAX_ROWS: usize = 1;

/// The bindings of a fused product: float activations `[rows, k]`, the packed weight `[n, k]`
/// with its group scales, and the output `[rows, n]`.
pub struct FusedArgs {
    pub x: Binding,
    pub words: Binding,
    pub w_scales: Binding,
    pub out: Binding,
}

/// Enqueues the product of float activations with a packed weight as one kernel (`kinds`: the
/// output's and the activations' element types): each cube quantizes the activations into shared
/// memory, then strides over output features.
/// Returns `false` (enqueuing nothing) beyond [`FUSED_MAX_ROWS`] rows, when the codes exceed
/// [`FUSED_MAX_SHARED`], or when `KILN_TERNARY_GEMV_FUSED=0` asks for the two-kernel path (to
/// measure one against the other).
pub fn launch_gemv_fused(client: &ComputeClient<CudaRuntime>, kinds: [FloatKind; 2], rows: usize, n: usize, k: usize, group: usize, args: FusedArgs) -> bool {
    let kv = k.div_ceil(ROW_GRANULE);
    let shared = rows * kv * ROW_GRANULE;
    if rows > FUSED_MAX_ROWS || shared > FUSED_MAX_SHARED || crate::measurement_override("KILN_TERNARY_GEMV_FUSED", 0..=1) == Some(0) {
        return false;
    }
    let [out_kind, in_kind] = kinds;
    let cube = fused_cube(kv);
    let (threads, features) = device_tiling(client, rows, n, k);
    let kernel = kernel("kiln_ternary_gemv_fused", rows, (threads, features), [out_kind, in_kind], cube, shared);
    // Every cube quantizes the whole activation once, so the grid is as many cubes as can be
    // resident (by threads and shared memory), each striding over the features.
    let hardware = &client.properties().hardware;
    let resident = (2048 / cube).min(hardware.max_shared_memory_size / (shared + 1024)).max(1);
    // The same number of strides for every cube.
    let needed = (n.div_ceil(features) * threads).div_ceil(cube);
    let iterations = needed.div_ceil(resident * hardware.num_streaming_multiprocessors.unwrap_or(132) as usize);
    let cubes = needed.div_ceil(iterations);
    let buffers = vec![args.x, args.words, args.w_scales, args.out];
    // `FusedParams`: the shape's `Params`, then the row length and the strides.
    let params = [&shape_params(n, k, group)[..], &[k as u32, iterations as u32]].concat();
    kernel.launch(client, CubeCount::Static(cubes as u32, 1, 1), buffers, &params);
    true
}
