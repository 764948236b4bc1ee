//! 4-bit weights on the H100: parity (the product and its input gradient in f32/bf16, the kernels'
//! codes against the host format at Llama sizes) and the tables — GEMV, prefill products
//! and a QLoRA step's forward+backward — next to bf16 (kiln); bitsandbytes and torch run in
//! `peers/nf4.py` in the same call.

use std::time::Instant;

use burn::backend::{Autodiff, cuda::CudaDevice};
use burn::tensor::{DType, Distribution, Tensor};
use burn_cubecl::CubeBackend;
use cubecl::cuda::CudaRuntime;
use kiln::ops::{self, nf4::{Packed4, QuantType, Quantized4}};
use kiln_kernels::cuda_source::FloatKind;

use super::common::{self, checks::Nf4Case};
use super::{B, bf16};

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;

/// The GEMV shapes as `(k, n)` (weights `[n, k]`).
const GEMV: [(usize, usize); 4] = [(4096, 4096), (4096, 11008), (11008, 4096), (8192, 28672)];
/// Llama-7B linear shapes for the prefill products.
const PREFILL: [(usize, usize); 3] = [(4096, 4096), (4096, 11008), (11008, 4096)];

pub fn parity_cases() -> Vec<Nf4Case> {
    let case = |m, k, n, kind, block, nested, seed| Nf4Case { m, k, n, kind, block, nested, seed };
    vec![
        case(1, 4096, 512, QuantType::Nf4, 64, true, 1),
        case(3, 1000, 33, QuantType::Nf4, 64, false, 2),
        case(8, 2048, 301, QuantType::Fp4, 128, true, 3),
        case(17, 520, 96, QuantType::Nf4, 64, true, 4),
        case(512, 1024, 257, QuantType::Nf4, 4096, false, 5),
        case(2, 100, 9, QuantType::Nf4, 32, false, 6),
        // Half-precision rows of these take the tensor-core GEMV on CUDA: ragged `n`, plain and
        // nested scales, blocks of 64 and 256, one span.
        case(5, 1152, 37, QuantType::Nf4, 64, false, 7),
        case(4, 768, 16, QuantType::Nf4, 256, true, 8),
        case(7, 4096, 1000, QuantType::Fp4, 64, true, 9),
        case(1, 64, 1, QuantType::Nf4, 64, false, 10),
    ]
}

/// Products on the Hopper GEMM (`kiln_kernels::nf4::wgmma`): ragged rows and features, plain and
/// nested scales, blocks of 64 to 4096, NF4 and FP4, and launches whose reduction is split over
/// clusters of two and three cubes (few tiles) or not (a full wave). Sizes keep the host's f64
/// oracle within seconds.
pub fn gemm_parity_cases() -> Vec<Nf4Case> {
    let case = |m, k, n, kind, block, nested, seed| Nf4Case { m, k, n, kind, block, nested, seed };
    vec![
        case(9, 64, 1, QuantType::Nf4, 64, false, 21),
        case(17, 576, 96, QuantType::Nf4, 64, true, 22),
        case(300, 2560, 1000, QuantType::Nf4, 64, true, 23), // 16 tiles: three cubes a tile
        case(512, 1024, 257, QuantType::Nf4, 4096, false, 24), // 2 blocks a cube at most: two
        case(777, 1088, 4100, QuantType::Fp4, 128, true, 25), // 132 tiles: one
        case(2048, 1024, 640, QuantType::Nf4, 256, true, 26),
        case(1100, 1280, 300, QuantType::Nf4, 64, false, 27),
    ]
}

/// The GEMV alone in half precision (on CUDA the tensor-core kernel where the shape allows,
/// the portable one elsewhere), forward, against an f64 oracle of the same dequantized weight,
/// with dequantize + Burn's matmul in the same dtype as the reference path for the error rule.
/// The parity mode's autodiff cases take about a minute each on the H100 (the reference path's
/// kernels compile per shape); this takes seconds, so every GEMV case runs in f16 and bf16.
pub fn gemv_parity(device: &CudaDevice) -> bool {
    let cases = parity_cases().into_iter().filter(|c| c.m <= kiln_kernels::nf4::mma::MMA_MAX_ROWS).collect();
    product_parity(device, cases, "gemv")
}

/// [`gemv_parity`] for the Hopper GEMM's cases ([`gemm_parity_cases`]), each line naming the
/// path that ran.
pub fn gemm_parity(device: &CudaDevice) -> bool {
    product_parity(device, gemm_parity_cases(), "gemm")
}

/// `matmul_4bit` on `CubeBackend` in bf16 and f16 for each case, against the f64 oracle.
fn product_parity(device: &CudaDevice, cases: Vec<Nf4Case>, what: &str) -> bool {
    let mut ok = true;
    for case in cases {
        let packed = case.packed();
        let w: Vec<f64> = packed.dequantize().into_iter().map(f64::from).collect();
        let q = Quantized4::<Cube>::from_host(&packed, device).unwrap();
        let (m, k, n) = (case.m, case.k, case.n);
        for dtype in [DType::BF16, DType::F16] {
            let x = common::tensor::<Cube, 2>(&common::random(&[m, k], case.seed), dtype, device);
            let xs = common::values(x.clone());
            common::poison::<Cube>(device, m * n, dtype);
            let y = common::values(ops::matmul_4bit(x.clone(), &q));
            let dense: Tensor<Cube, 2> = common::checks::wrap(ops::nf4::reference::dequantize::<Cube>(q.primitive(), dtype));
            let r = common::values(x.matmul(dense.transpose()));
            let oracle: Vec<f64> = (0..m * n).map(|i| (0..k).map(|j| xs[i / n * k + j] * w[i % n * k + j]).sum()).collect();
            let c = common::compare("y", &y, &r, &oracle, dtype, k as f64);
            // Both sides sum in f32 and round once to the output dtype, so the harness's rounding
            // term (which grows with √k: 4 · u · max|y| · 64 at k = 4096 in bf16, the size of the
            // outputs themselves) would pass a wrongly permuted product; the bound here allows
            // twice the reference's error plus four output roundings.
            let bound = 2.0 * c.reference_err + 4.0 * common::unit_roundoff(dtype) * c.scale;
            let pass = c.kernel_err.is_finite() && c.kernel_err <= bound;
            println!(
                "parity nf4 {what} {case:?} {dtype:?} [{}] kernel_err {:.3e} ref_err {:.3e} bound {bound:.3e} {}",
                path(m, n, k, case.block, dtype),
                c.kernel_err,
                c.reference_err,
                if pass { "ok" } else { "FAIL" }
            );
            ok &= pass;
        }
    }
    ok
}

/// Which product `matmul_4bit` takes for `m` rows of `dtype` against `[n, k]` on this H100/H200
/// (the device checks pass there).
fn path(m: usize, n: usize, k: usize, block: usize, dtype: DType) -> &'static str {
    let kind = if dtype == DType::F16 { FloatKind::F16 } else { FloatKind::Bf16 };
    if kiln_kernels::nf4::mma::enabled() && kiln_kernels::nf4::mma::mma_fits(kind, m, n, k, block) {
        "tensor-core gemv"
    } else if kiln_kernels::nf4::wgmma::serves(kind, m, n, k, block) {
        "wgmma gemm"
    } else {
        "dequantize + gemm"
    }
}

pub fn exact_quantization(device: &CudaDevice) -> bool {
    let mut ok = true;
    for (dtype, [n, k]) in [(DType::BF16, [4096, 4096]), (DType::F32, [11008, 4096]), (DType::BF16, [33, 520])] {
        let w = Tensor::<B, 2>::random([n, k], Distribution::Normal(0.0, 0.02), device).cast(dtype);
        let host: Vec<f32> = w.clone().into_data().convert::<f32>().into_vec().unwrap();
        for kind in [QuantType::Nf4, QuantType::Fp4] {
            for (block, nested) in [(64, true), (128, false), (4096, false)] {
                let start = Instant::now();
                let ours = Quantized4::<B>::quantize(w.clone(), kind, block, nested);
                let expected = Packed4::quantize(&host, &[n, k], kind, block, nested).unwrap();
                let got = ours.to_host();
                let codes = got.data.iter().zip(&expected.data).filter(|(a, b)| a != b).count();
                let (a, b) = (got.absmax.values(), expected.absmax.values());
                let scales = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                let pass = codes == 0 && scales == 0;
                ok &= pass;
                println!(
                    "parity nf4 quantize [{n}, {k}] {dtype:?} {kind:?} block {block} nested {nested}: {codes} code bytes and {scales} scales differ from the host format ({:.1} s) {}",
                    start.elapsed().as_secs_f64(),
                    if pass { "ok" } else { "FAIL" }
                );
            }
        }
    }
    ok
}

/// An NF4 weight at block 64, double-quantized unless `KILN_NF4_NESTED=0` (for measurements).
pub(super) fn weight<BK: burn::tensor::backend::Backend<Device = CudaDevice> + ops::nf4::Nf4Backend>(k: usize, n: usize, device: &CudaDevice) -> Quantized4<BK> {
    let w = Tensor::<BK, 2>::random([n, k], Distribution::Normal(0.0, 0.02), device).cast(DType::BF16);
    let nested = std::env::var("KILN_NF4_NESTED").as_deref() != Ok("0");
    Quantized4::quantize(w, QuantType::Nf4, 64, nested)
}


/// GEMV (1, 4 and 8 rows; 8 takes dequantize + GEMM; `KILN_NF4_ROWS=1,4` picks): per-call time through Burn (fusion) and the GPU's own time (on
/// `CubeBackend`, calls enqueued behind busy work), bytes of the 4-bit weight read per product,
/// next to kiln's bf16 GEMV on the same shapes.
pub fn bench_gemv(device: &CudaDevice) {
    // `KILN_NF4_SHAPES=28672x8192,..` picks shapes (`n`x`k`), for profiling.
    let only = std::env::var("KILN_NF4_SHAPES").ok();
    for (k, n) in GEMV.into_iter().filter(|(k, n)| only.as_deref().is_none_or(|o| o.split(',').any(|s| s == format!("{n}x{k}")))) {
        let w = weight::<B>(k, n, device);
        let wc = weight::<Cube>(k, n, device);
        let dense = bf16::<B, 2>([k, n], device);
        let dense_c = bf16::<Cube, 2>([k, n], device);
        let rows: Vec<usize> = std::env::var("KILN_NF4_ROWS").map(|v| v.split(',').filter_map(|r| r.parse().ok()).collect()).unwrap_or_else(|_| vec![1, 4, 8]);
        for &m in &rows {
            let (x, xc) = (bf16::<B, 2>([m, k], device), bf16::<Cube, 2>([m, k], device));
            let nf4 = super::time_both(device, || ops::matmul_4bit(x.clone(), &w), || ops::matmul_4bit(xc.clone(), &wc));
            let dense16 = super::time_both(device, || ops::matmul(x.clone(), dense.clone()), || ops::matmul(xc.clone(), dense_c.clone()));
            let packed = w.bytes() as f64 + 2.0 * (m * (k + n)) as f64;
            let dense_bytes = 2.0 * (k * n + m * (k + n)) as f64;
            println!(
                "bench nf4 gemv m{m} k{k:<6} n{n:<6} kiln nf4: {:7.1} us/call, GPU {:6.1} us ({:5.0} GB/s of {:.1} MB packed; {:.1} us/call to enqueue) | kiln bf16: {:7.1} us/call, GPU {:6.1} us ({:5.0} GB/s) | nf4/bf16 GPU speedup {:.2}x",
                nf4.per_call * 1e6,
                nf4.gpu * 1e6,
                packed / nf4.gpu / 1e9,
                packed / 1e6,
                nf4.enqueue * 1e6,
                dense16.per_call * 1e6,
                dense16.gpu * 1e6,
                dense_bytes / dense16.gpu / 1e9,
                dense16.gpu / nf4.gpu
            );
        }
    }
}

/// Prefill products next to the bf16 product: per call through Burn (fusion) and the GPU's own
/// time (on `CubeBackend`, calls enqueued behind busy work), each line naming the path
/// (`KILN_NF4_WGMMA=0` turns the Hopper GEMM off; `KILN_NF4_ROWS=512,1024` picks the rows).
pub fn bench_prefill(device: &CudaDevice) {
    let rows: Vec<usize> = std::env::var("KILN_NF4_ROWS").map(|v| v.split(',').filter_map(|r| r.parse().ok()).collect()).unwrap_or_else(|_| vec![512, 1024, 2048, 8192]);
    for (k, n) in PREFILL {
        let (w, wc) = (weight::<B>(k, n, device), weight::<Cube>(k, n, device));
        let (dense, dense_c) = (bf16::<B, 2>([k, n], device), bf16::<Cube, 2>([k, n], device));
        for &m in &rows {
            let (x, xc) = (bf16::<B, 2>([m, k], device), bf16::<Cube, 2>([m, k], device));
            let t = super::time_both(device, || ops::matmul_4bit(x.clone(), &w), || ops::matmul_4bit(xc.clone(), &wc));
            let bf = super::time_both(device, || ops::matmul(x.clone(), dense.clone()), || ops::matmul(xc.clone(), dense_c.clone()));
            let flops = 2.0 * (m * k * n) as f64;
            println!(
                "bench nf4 prefill m{m:<5} k{k:<6} n{n:<6} [{}] kiln nf4 {:8.4} ms/call, GPU {:8.4} ms ({:4.0} TF/s) | kiln bf16 {:8.4} ms/call, GPU {:8.4} ms ({:4.0} TF/s) | nf4/bf16 per call {:.2}x, GPU {:.2}x",
                path(m, n, k, 64, DType::BF16),
                t.per_call * 1e3,
                t.gpu * 1e3,
                flops / t.gpu / 1e12,
                bf.per_call * 1e3,
                bf.gpu * 1e3,
                flops / bf.gpu / 1e12,
                bf.per_call / t.per_call,
                bf.gpu / t.gpu
            );
        }
    }
}

/// A QLoRA step's base layer: forward and input gradient through `Autodiff` at 4096 → 11008,
/// 4096 tokens (the frozen weight gets no gradient).
pub fn bench_qlora_step(device: &CudaDevice) {
    type Ad = Autodiff<B>;
    let (m, k, n) = (4096, 4096, 11008);
    let w = weight::<Ad>(k, n, device);
    let x = bf16::<Ad, 2>([m, k], device).require_grad();
    let dy = bf16::<Ad, 2>([m, n], device);
    let step = || {
        let y = ops::matmul_4bit(x.clone(), &w);
        let grads = (y * dy.clone()).sum().backward();
        x.grad(&grads).unwrap()
    };
    let t = super::time_adaptive(device, 0.2, 50, step);
    let loss_only = super::time_adaptive(device, 0.2, 50, || {
        let y = dy.clone().require_grad();
        let grads = (y.clone() * dy.clone()).sum().backward();
        y.grad(&grads).unwrap()
    });
    let flops = 2.0 * 2.0 * (m * k * n) as f64;
    println!(
        "bench nf4 qlora step m{m} k{k} n{n} fwd+bwd(x): kiln {:.3} ms ({:.3} ms of it the loss ops; {:.0} TF/s net)",
        t * 1e3,
        loss_only * 1e3,
        flops / (t - loss_only) / 1e12
    );
}
