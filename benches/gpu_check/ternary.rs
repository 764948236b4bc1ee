//! BitNet W2A8 on the H100: the CI tests' checks (codes, activation codes and products against the
//! host definition, exact; straight-through gradients) at Llama sizes in f32, f16 and bf16, and
//! the tables — GEMV at BitNet's and Llama's shapes, prefill products, a QAT linear step —
//! next to kiln's bf16 products; torch and HF's BitLinear run in `peers/ternary.py`, same call.

use std::time::Instant;

use burn::backend::{Autodiff, cuda::CudaDevice};
use burn::tensor::{DType, Tensor, TensorPrimitive, backend::Backend};
use burn_cubecl::CubeBackend;
use cubecl::cuda::CudaRuntime;
use kiln::ops::{self, ternary::{TernaryBackend, TernaryWeight}};

use super::common::ternary::{check_gradients, check_kernels, check_normed, shape};
use super::{B, HBM, bf16, held_by};

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;

/// `(n, k)`: BitNet's GEMV table (weights `[n, k]`) and Llama's 4096 → 11008 and 8192 → 28672.
const GEMV: [(usize, usize); 7] = [(2560, 2560), (13824, 2560), (2560, 6912), (3200, 10240), (20480, 3200), (11008, 4096), (28672, 8192)];
const PREFILL: [(usize, usize); 3] = [(11008, 4096), (4096, 11008), (28672, 8192)];
/// Dense bf16 tensor-core peak of the H100 SXM, operations per second.
const BF16_PEAK: f64 = 989e12;
/// Dense int8 tensor-core peak of the H100 SXM, operations per second.
const INT8_PEAK: f64 = 1979e12;

/// The CI checks on CUDA: GEMV rows (one row: the fused `dp4a` kernel, with 16-byte loads at
/// 6912 and 20000 (cubes of 512 and 1024 threads) and element loads at 1000; one row of 100000,
/// beyond its shared memory, and 3, 5 and 8 rows: the two-kernel path, from compute capability
/// 8.0 the integer MMA kernel) and GEMM rows at model sizes (on the H100 the wgmma GEMM: 17 rows,
/// 512, and 300 rows against a ragged `[1001, 2600]` weight whose last k block is half padding),
/// and under its stream-K schedule: shared blocks alone, whole waves then shared blocks.
pub fn parity(device: &CudaDevice) -> bool {
    let shapes = [
        shape(1, 2560, 6912, 2560),
        shape(1, 97, 1000, 97),
        shape(1, 515, 20000, 515),
        shape(1, 8, 100000, 8),
        shape(8, 4096, 11008, 1),
        shape(3, 301, 1000, 64),
        shape(5, 37, 200, 37),
        shape(17, 1024, 4096, 1024),
        shape(512, 640, 2048, 640),
        shape(300, 1001, 2600, 7),
        shape(40, 700, 3000, 700),
        // On 132 SMs the wgmma GEMM splits k over a cluster for the last four above (3, 2, 2 and
        // 3 cubes a tile: `wgmma::grid`) and takes its stream-K schedule for the next two (k of
        // 3000: 24 blocks, the last half padding): 133 ragged tiles, all their blocks shared over
        // the 132 cubes; 300 ragged tiles, one whole wave, then the last 168 tiles' blocks shared
        // (a tile's owner gathering from one helper).
        shape(33, 17000, 3000, 17000),
        shape(33, 38363, 3000, 38363),
    ];
    let mut ok = true;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let start = Instant::now();
        let pass = std::panic::catch_unwind(|| check_kernels::<B>(device, dtype, &shapes)).is_ok();
        println!("parity ternary kernels {dtype:?} (packing, activation codes, W2A8 products exact): {} ({:.1} s)", verdict(pass), start.elapsed().as_secs_f64());
        ok &= pass;
        let start = Instant::now();
        // On the H100 the f16/bf16 input gradients of the first four run on the wgmma kernel:
        // 128-row cubes for the first three (300 rows over three tiles, a reduction of 1000 =
        // 15 blocks and a half, 7-row scale groups), 256-row cubes for 600 × 3000 (72 of them);
        // 1001 weight rows are not whole 16-byte dy rows and take the cuBLASLt path.
        let grads = [shape(64, 512, 1000, 512), shape(5, 96, 4096, 1), shape(300, 1000, 2600, 7), shape(600, 512, 3000, 512), shape(17, 1001, 640, 1001)];
        // kiln's f32 products run on the tensor cores in TF32 (`ops::matmul`).
        let tf32 = if dtype == DType::F32 { 2f64.powi(-11) } else { 0.0 };
        let pass = std::panic::catch_unwind(|| check_gradients::<Autodiff<B>>(device, dtype, tf32, &grads)).is_ok();
        println!("parity ternary straight-through gradients {dtype:?}: {} ({:.1} s)", verdict(pass), start.elapsed().as_secs_f64());
        ok &= pass;
        let start = Instant::now();
        // BitLinear's input norm inside the quantization: one row (the norm's kernel, then the
        // fused `dp4a` GEMV), 5 rows, and the wgmma GEMM (ragged 300 × [1001, 2600], 512 rows).
        let normed = [shape(1, 515, 2000, 515), shape(5, 37, 200, 37), shape(300, 1001, 2600, 7), shape(512, 640, 2048, 640)];
        let pass = std::panic::catch_unwind(|| check_normed::<Autodiff<B>>(device, dtype, tf32, &normed)).is_ok();
        println!("parity ternary input norm inside the quantization {dtype:?} (rstd, products exact, gradients of x, gamma, W): {} ({:.1} s)", verdict(pass), start.elapsed().as_secs_f64());
        ok &= pass;
    }
    ok
}

fn verdict(pass: bool) -> &'static str {
    if pass { "ok" } else { "FAIL" }
}


pub(super) fn weight<BK: Backend<Device = CudaDevice> + ops::ternary::TernaryBackend>(n: usize, k: usize, device: &CudaDevice) -> TernaryWeight<BK> {
    TernaryWeight::quantize(bf16::<BK, 2>([n, k], device), n)
}

/// GEMV at 1, 4 and 8 rows: per-call time through Burn (fusion) and the GPU's own time (on
/// `CubeBackend`, calls queued behind busy work; activation quantization included), next to
/// kiln's bf16 product of the same shape.
pub fn bench_gemv(device: &CudaDevice) {
    // `KILN_TERNARY_SHAPES=20480x3200,..` picks shapes (`n`x`k`), for profiling.
    let only = std::env::var("KILN_TERNARY_SHAPES").ok();
    for (n, k) in GEMV.into_iter().filter(|(n, k)| only.as_deref().is_none_or(|o| o.split(',').any(|s| s == format!("{n}x{k}")))) {
        let (w, wc) = (weight::<B>(n, k, device), weight::<Cube>(n, k, device));
        let (dense, dense_c) = (bf16::<B, 2>([k, n], device), bf16::<Cube, 2>([k, n], device));
        for m in [1, 4, 8] {
            let (x, xc) = (bf16::<B, 2>([m, k], device), bf16::<Cube, 2>([m, k], device));
            let w2a8 = super::time_both(device, || ops::ternary_matmul(x.clone(), &w), || ops::ternary_matmul(xc.clone(), &wc));
            let dense16 = super::time_both(device, || ops::matmul(x.clone(), dense.clone()), || ops::matmul(xc.clone(), dense_c.clone()));
            let packed = w.layout.bytes() as f64 + (2 * m * (k + n)) as f64;
            let dense_bytes = 2.0 * (k * n + m * (k + n)) as f64;
            println!(
                "bench ternary gemv m{m} n{n:<6} k{k:<6} kiln W2A8: {:7.1} us/call, GPU {:6.1} us ({:5.0} GB/s, {:4.1}% of HBM on {:.1} MB packed; {:.1} us/call to enqueue) | kiln bf16: {:7.1} us/call, GPU {:6.1} us ({:5.0} GB/s) | W2A8/bf16 GPU speedup {:.2}x",
                w2a8.per_call * 1e6,
                w2a8.gpu * 1e6,
                packed / w2a8.gpu / 1e9,
                100.0 * packed / w2a8.gpu / HBM,
                packed / 1e6,
                w2a8.enqueue * 1e6,
                dense16.per_call * 1e6,
                dense16.gpu * 1e6,
                dense_bytes / dense16.gpu / 1e9,
                dense16.gpu / w2a8.gpu
            );
        }
    }
}

/// Calls a timing sample may make when each call's results, which the sample holds until its
/// end, take `bytes`: at most 8 GB a sample. Two hundred calls of `[8192, n]` products or of
/// `relu2_glu`'s `[16384, 6912]` gradients ran an H100's 80 GB out of memory (29th session).
fn calls_within(bytes: usize) -> usize {
    const SAMPLE_BYTES: usize = 8 << 30;
    (SAMPLE_BYTES / bytes.max(1)).clamp(3, 200)
}

/// One line of a ternary product next to kiln's bf16 product of the same shape: both times (s),
/// kiln's rate and share of `peak` (`(unit, name, ops/s)`), and the speed ratio.
fn compare(label: &str, [t, bf]: [f64; 2], flops: f64, (unit, peak_name, peak): (&str, &str, f64), ratio: &str) {
    println!(
        "bench ternary {label} {:8.3} ms ({:4.0} {unit}, {:2.0}% of {peak_name} peak) | kiln bf16 {:8.3} ms ({:4.0} TF/s) | {ratio} {:.2}x",
        t * 1e3,
        flops / t / 1e12,
        100.0 * flops / t / peak,
        bf * 1e3,
        flops / bf / 1e12,
        bf / t
    );
}

/// The prefill weights `(n, k)` and activation rows: [`PREFILL`] at 512, 2048 and 8192 rows, or
/// as `KILN_TERNARY_PREFILL=6912x2560,..` (`n`x`k`) and `KILN_TERNARY_PREFILL_ROWS=512,2048` pick
/// (BitNet b1.58 2B's products, say), as `benches/peers/ternary.py` takes `PREFILL`.
fn prefill_products() -> (Vec<(usize, usize)>, Vec<usize>) {
    let shapes = env_lists("KILN_TERNARY_PREFILL").map_or_else(|| PREFILL.to_vec(), |l| l.into_iter().filter_map(|d| if let [n, k] = d[..] { Some((n, k)) } else { None }).collect());
    let rows = env_lists("KILN_TERNARY_PREFILL_ROWS").map_or_else(|| vec![512, 2048, 8192], |l| l.into_iter().filter_map(|d| d.first().copied()).collect());
    (shapes, rows)
}

/// `VAR=axb,c` as lists of numbers (`x` between the numbers of an item), if set.
fn env_lists(var: &str) -> Option<Vec<Vec<usize>>> {
    let v = std::env::var(var).ok()?;
    Some(v.split(',').map(|s| s.split('x').filter_map(|d| d.parse().ok()).collect()).collect())
}

/// Prefill products (on the H100 the activation kernel and the wgmma GEMM; with
/// `KILN_TERNARY_WGMMA=0` the weight unpacked to int8 and cuBLASLt's i8 GEMM, then the scales)
/// next to kiln's bf16 product (cuBLASLt), with the share of the H100's dense int8 peak.
pub fn bench_prefill(device: &CudaDevice) {
    let (shapes, rows) = prefill_products();
    for (n, k) in shapes {
        let w = weight::<B>(n, k, device);
        let dense = bf16::<B, 2>([k, n], device);
        for &m in &rows {
            let x = bf16::<B, 2>([m, k], device);
            let calls = calls_within(m * n * 2);
            let t = super::time_adaptive(device, 0.1, calls, || ops::ternary_matmul(x.clone(), &w));
            let bf = super::time_adaptive(device, 0.1, calls, || ops::matmul(x.clone(), dense.clone()));
            compare(&format!("prefill m{m:<5} n{n:<6} k{k:<6} kiln W2A8"), [t, bf], 2.0 * (m * k * n) as f64, ("TOP/s", "int8", INT8_PEAK), "W2A8/bf16");
        }
    }
}

/// The prefill products once each, twice a shape and in `bench_prefill`'s order, for a profiler
/// to time the activation kernel and the GEMM of each launch (`ncu -k regex:quantize|gemm`).
pub fn prefill_once(device: &CudaDevice) {
    let (shapes, rows) = prefill_products();
    for (n, k) in shapes {
        let w = weight::<B>(n, k, device);
        for &m in &rows {
            let x = bf16::<B, 2>([m, k], device);
            println!("prefill once m{m} n{n} k{k}");
            for _ in 0..2 {
                let _ = ops::ternary_matmul(x.clone(), &w).into_data();
            }
        }
    }
}

/// The packed weight's input gradient `dy · W̃` (on the H100 the wgmma kernel that expands the
/// packed weight in shared memory; with `KILN_TERNARY_GRAD_WGMMA=0` the dequantized weight through
/// cuBLASLt) next to kiln's bf16 product of the same shape (cuBLASLt on a dense weight), with the
/// share of the H100's dense bf16 peak.
pub fn bench_input_grad(device: &CudaDevice) {
    for (n, k) in PREFILL {
        let w = weight::<B>(n, k, device).primitive();
        let dense = bf16::<B, 2>([n, k], device);
        for m in [512, 2048, 8192] {
            let dy = bf16::<B, 2>([m, n], device);
            let calls = calls_within(m * k * 2);
            let t = super::time_adaptive(device, 0.1, calls, || {
                Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::ternary_input_grad(dy.clone().into_primitive().tensor(), w.clone())))
            });
            let bf = super::time_adaptive(device, 0.1, calls, || ops::matmul(dy.clone(), dense.clone()));
            compare(&format!("input grad m{m:<5} n{n:<6} k{k:<6} kiln packed"), [t, bf], 2.0 * (m * k * n) as f64, ("TF/s", "bf16", BF16_PEAK), "packed/bf16");
        }
    }
}

/// QAT linears `(n, k)`: the 4096 → 11008, then each linear of a Llama-3.2-1B layer (q and
/// o, k and v, gate and up, down), the shapes of the whole-model step that `qat_step` times.
const QAT: [(usize, usize); 5] = [(11008, 4096), (2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)];

/// A QAT step of one linear at each [`QAT`] shape (4096 tokens, bf16): `bitlinear` forward and
/// forward + backward (both gradients), the same with BitLinear's input RMSNorm (γ trained too)
/// as its own op before `bitlinear` and inside the quantization (`bitlinear_normed`), next to
/// kiln's bf16 linear; and the device memory each forward holds for its backward (per layer, the
/// step's memory that grows with depth). Where a whole model's QAT step loses to its
/// float form, these rows say which part of the layer it is.
pub fn bench_qat_step(device: &CudaDevice) {
    type Ad = Autodiff<B>;
    let m = 4096;
    for (n, k) in QAT {
        let x = bf16::<Ad, 2>([m, k], device).require_grad();
        let gamma = bf16::<Ad, 1>([k], device).require_grad();
        let latent = bf16::<Ad, 2>([n, k], device).require_grad();
        let dense = bf16::<Ad, 2>([k, n], device).require_grad();
        let dy = bf16::<Ad, 2>([m, n], device);
        let normed = || ops::rms_norm(x.clone(), gamma.clone(), 1e-6);
        let step = |y: Tensor<Ad, 2>, weight: &Tensor<Ad, 2>| {
            let grads = (y * dy.clone()).sum().backward();
            (x.grad(&grads).unwrap(), weight.grad(&grads).unwrap())
        };
        let (qat_held, y) = held_by(device, || ops::bitlinear(x.clone(), latent.clone(), n));
        drop(y);
        let (plain_held, y) = held_by(device, || ops::matmul(x.clone(), dense.clone()));
        drop(y);
        let (separate_held, y) = held_by(device, || ops::bitlinear(normed(), latent.clone(), n));
        drop(y);
        let (fused_held, y) = held_by(device, || ops::bitlinear_normed(x.clone(), gamma.clone(), 1e-6, latent.clone(), n));
        drop(y);
        let time = |f: &mut dyn FnMut()| super::time_adaptive(device, 0.2, 50, f);
        let qat_fwd = time(&mut || drop(ops::bitlinear(x.clone(), latent.clone(), n)));
        let plain_fwd = time(&mut || drop(ops::matmul(x.clone(), dense.clone())));
        let qat = time(&mut || drop(step(ops::bitlinear(x.clone(), latent.clone(), n), &latent)));
        let plain = time(&mut || drop(step(ops::matmul(x.clone(), dense.clone()), &dense)));
        let normed_qat = time(&mut || drop(step(ops::bitlinear(normed(), latent.clone(), n), &latent)));
        let fused_qat = time(&mut || drop(step(ops::bitlinear_normed(x.clone(), gamma.clone(), 1e-6, latent.clone(), n), &latent)));
        let flops = 3.0 * 2.0 * (m * k * n) as f64;
        println!(
            "bench ternary qat m{m} n{n:<5} k{k:<5} fwd+bwd: bitlinear {:.3} ms ({:.0} TF/s) | bf16 linear {:.3} ms ({:.0} TF/s) | bitlinear/bf16 {:.2}x the time | with the input norm: separate {:.3} ms ({:.2}x), fused {:.3} ms ({:.2}x) | fwd alone {:.3} / {:.3} ms | held for the backward {:.1} / {:.1} MB, with the norm separate {:.1} / fused {:.1} MB (output {:.1} MB)",
            qat * 1e3,
            flops / qat / 1e12,
            plain * 1e3,
            flops / plain / 1e12,
            qat / plain,
            normed_qat * 1e3,
            normed_qat / plain,
            fused_qat * 1e3,
            fused_qat / plain,
            qat_fwd * 1e3,
            plain_fwd * 1e3,
            qat_held / 1e6,
            plain_held / 1e6,
            separate_held / 1e6,
            fused_held / 1e6,
            (2 * m * n) as f64 / 1e6
        );
    }
}

/// BitNet's MLP gating (`max(g, 0)² · u`, BitNet b1.58 2B's 6912 features, 16384 tokens, bf16):
/// kiln's one-pass `relu2_glu` forward and forward + backward; torch's eager and compiled forms
/// run in `peers/ternary.py`. Memory-bound: reported as a fraction of HBM.
pub fn bench_relu2_glu(device: &CudaDevice) {
    type Ad = Autodiff<B>;
    let (t, f) = (16384, 6912);
    let (gate, up) = (bf16::<Ad, 2>([t, f], device).require_grad(), bf16::<Ad, 2>([t, f], device).require_grad());
    let dy = bf16::<Ad, 2>([t, f], device);
    let forward = super::time_adaptive(device, 0.2, calls_within(t * f * 2), || ops::relu2_glu(gate.clone().inner(), up.clone().inner()));
    let both = super::time_adaptive(device, 0.2, calls_within(2 * t * f * 2), || {
        let grads = (ops::relu2_glu(gate.clone(), up.clone()) * dy.clone()).sum().backward();
        (gate.grad(&grads).unwrap(), up.grad(&grads).unwrap())
    });
    let bytes = (t * f * 2) as f64;
    println!(
        "bench ternary relu2_glu [{t},{f}] bf16: kiln fwd {:.1} us ({:.0}% HBM) | kiln fwd+bwd (autodiff, incl. the loss ops) {:.1} us ({:.0}% HBM on 8 passes)",
        forward * 1e6,
        100.0 * 3.0 * bytes / forward / HBM,
        both * 1e6,
        100.0 * 8.0 * bytes / both / HBM
    );
}
