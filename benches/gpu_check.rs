//! The GPU check: parity of every kiln op on CUDA (f32 and bf16, forward and backward, through the
//! same harness as the CI tests) and timings at Llama-7B shapes next to Burn's composed ops.
//!
//! Build: `scripts/gpu-check-build` (one stripped binary in `gpu/`); run on the GPU machine:
//! `gpu/kiln-gpu-check [parity [FILTER]|parity-tensor-cores [f16]|bench|attention|attention-fwd|gemm|...|all]`
//! (README lists every mode).

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "gpu_check/attention.rs"]
mod attention;
#[path = "gpu_check/cross_entropy.rs"]
mod cross_entropy;
#[path = "gpu_check/linear_cross_entropy.rs"]
mod linear_cross_entropy;
#[path = "gpu_check/gemm.rs"]
mod gemm;
#[path = "gpu_check/dora.rs"]
mod dora;
#[path = "gpu_check/host_profile.rs"]
mod host_profile;
#[path = "gpu_check/lora.rs"]
mod lora;
#[path = "gpu_check/nf4.rs"]
mod nf4;
#[path = "gpu_check/sketch.rs"]
mod sketch;
#[path = "gpu_check/ternary.rs"]
mod ternary;
#[path = "gpu_check/timing.rs"]
mod timing;
#[path = "gpu_check/trit.rs"]
mod trit;

use std::time::Instant;

use burn::backend::{Autodiff, Cuda, cuda::CudaDevice};
use burn::tensor::{DType, Distribution, Tensor, activation, backend::Backend};
use common::checks::{AttentionCase, Case, GluCase, RmsNormCase, RmsNormRopeCase, RopeCase, check};
use kiln::ops::{self, AttentionOptions, RopeTable, flash_attention::FlashAttentionBackend, rope::RopeScaling, swiglu::GluActivation};

use timing::{bytes_in_use, gpu_time_per_call, held_by, sync_all, time, time_adaptive, time_both, time_few};

type B = Cuda<f32>;
type Ad = Autodiff<B>;

/// Parity of every case whose name contains each word of `filter` (all with an empty filter).
fn parity(device: &CudaDevice, filter: &str) -> bool {
    let mut ok = true;
    let mut report = |name: String, check: &dyn Fn() -> Vec<common::Comparison>| {
        if !filter.split_whitespace().all(|word| name.contains(word)) {
            return;
        }
        let start = Instant::now();
        let comparisons = check();
        println!("parity {name} ({:.1} s)", start.elapsed().as_secs_f64());
        for c in &comparisons {
            println!("parity {name:<58} {:<10} kernel_err {:.3e} ref_err {:.3e} bound {:.3e} {}", c.name, c.kernel_err, c.reference_err, c.bound, if c.passed() { "ok" } else { "FAIL" });
        }
        ok &= comparisons.iter().all(|c| c.passed());
    };
    for dtype in [DType::F32, DType::BF16] {
        for shape in [[1, 3, 4096], [2, 37, 1000], [1, 17, 5000], [4, 64, 4096]] {
            for residual in [false, true] {
                let case = RmsNormCase { shape, residual, seed: 1 };
                report(format!("rms_norm {shape:?} residual={residual} {dtype:?}"), &|| run_check(&case, device, dtype));
            }
        }
        for (shape, transposed) in [([2, 33, 32, 128], false), ([1, 100, 8, 64], true), ([1, 7, 4, 80], false)] {
            let case = RopeCase { shape, offset: 3, transposed, scaling: RopeScaling::None, seed: 2 };
            report(format!("rope {shape:?} transposed={transposed} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for (seq, hq, hk, d) in [(65, 32, 8, 128), (17, 14, 2, 64), (9, 4, 4, 80)] {
            let case = RmsNormRopeCase { batch: 2, seq, q_heads: hq, kv_heads: hk, head_dim: d, offset: 5, transposed: false, seed: 3 };
            report(format!("rms_norm_rope s{seq} hq{hq} hk{hk} d{d} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        let causal = AttentionOptions::causal();
        let attention = [
            AttentionCase { options: causal, ..AttentionCase::new(2, 8, 2, 257, 257, 128) },
            AttentionCase::new(1, 4, 4, 300, 1000, 64),
            AttentionCase { options: causal, ..AttentionCase::new(1, 32, 8, 1, 4000, 128) },
            AttentionCase { options: causal.with_window(64).with_softcap(30.0), bias: true, ..AttentionCase::new(1, 4, 2, 65, 300, 96) },
            AttentionCase { options: causal, ..AttentionCase::new(1, 2, 1, 100, 37, 80) },
            // Burn's reference path takes ~5 min here (autotune on new shapes); larger cases
            // (hq8 hk1 1000²) did not finish in 290 s, so they run forward-only in
            // `parity-tensor-cores`.
            AttentionCase { options: causal, ..AttentionCase::new(2, 4, 2, 100, 1000, 128) },
        ];
        for case in attention {
            report(format!("attention {case:?} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for case in gemm::parity_cases() {
            report(format!("gemm {case:?} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for case in nf4::parity_cases() {
            report(format!("nf4 {case:?} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for case in lora::parity_cases() {
            report(format!("lora {case:?} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for case in lora::linear_parity_cases() {
            report(format!("lora_linear {case:?} {dtype:?}"), &|| lora::with_fused_layer("1", || run_check(&case, device, dtype)));
        }
        for case in dora::op_cases() {
            report(format!("dora {case:?} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for case in dora::norm_cases() {
            report(format!("dora {case:?} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for case in dora::layer_cases() {
            report(format!("dora {case:?} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for case in cross_entropy::parity_cases() {
            report(format!("cross_entropy {case:?} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for case in linear_cross_entropy::parity_cases() {
            report(format!("linear_cross_entropy {case:?} {dtype:?}"), &|| run_check(&case, device, dtype));
        }
        for shape in [[37, 11008], [3, 1001]] {
            for activation in [GluActivation::Silu, GluActivation::GeluTanh, GluActivation::Relu2] {
                let case = GluCase { shape, activation, seed: 4 };
                report(format!("glu {shape:?} {activation:?} {dtype:?}"), &|| run_check(&case, device, dtype));
            }
        }
    }
    // f16 takes the same fused LoRA kernels as bf16, with the other MMA.
    for case in lora::parity_cases() {
        report(format!("lora {case:?} F16"), &|| run_check(&case, device, DType::F16));
    }
    for case in lora::linear_parity_cases() {
        report(format!("lora_linear {case:?} F16"), &|| lora::with_fused_layer("1", || run_check(&case, device, DType::F16)));
    }
    ok
}

fn run_check<C: Case>(case: &C, device: &CudaDevice, dtype: DType) -> Vec<common::Comparison> {
    check::<Ad, C>(case, device, dtype)
}

fn line(name: &str, seconds: f64, bytes: f64, copy_rate: f64) {
    let rate = bytes / seconds;
    println!("bench {name:<52} {:>9.3} ms {:>7.0} GB/s {:>5.1}% of copy", seconds * 1e3, rate / 1e9, 100.0 * rate / copy_rate);
}

fn rand<const D: usize>(shape: [usize; D], device: &CudaDevice) -> Tensor<B, D> {
    Tensor::<B, D>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(DType::BF16)
}

/// Timed calls a `bench` line averages.
const ITERS: usize = 20;

/// The copy rate: a bf16 tensor clone through Burn (read + write), the denominator of "% of copy".
fn copy_rate(device: &CudaDevice) -> f64 {
    let big = rand([16384, 8192], device);
    let copy_s = time(device, ITERS, || big.clone().mul_scalar(1.0));
    let rate = 2.0 * 2.0 * 16384.0 * 8192.0 / copy_s;
    println!("bench copy (x * 1, bf16 [16384, 8192]): {:.0} GB/s (read + write)", rate / 1e9);
    rate
}

/// CubeCL's backend without Burn's fusion: each op launches as it is called.
type Cube = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

/// A `bench` line of the GPU's own time per call of `f` on `CubeBackend` (calls queued behind
/// busy work, as the peers' CUDA-event timings see a kernel), beside the host's time to enqueue
/// one. `bytes` are the bytes a call moves; `out_bytes` those it allocates, which bound how many
/// calls stay queued at once.
fn gpu_line<T>(device: &CudaDevice, name: &str, bytes: f64, out_bytes: f64, f: impl FnMut() -> T) {
    let calls = (8e9 / out_bytes).clamp(20.0, 300.0) as usize;
    let (gpu, enqueue) = gpu_time_per_call::<Cube, _>(device, calls, f);
    println!(
        "bench {name:<52} GPU {:>8.1} us {:>7.0} GB/s; enqueue {:.1} us/call ({calls} calls)",
        gpu * 1e6,
        bytes / gpu / 1e9,
        enqueue / calls as f64 * 1e6
    );
}

/// RMSNorm's forward, its backward's kernels and an autodiff step on `[t, h]` bf16, beside Burn's
/// module.
fn bench_rms_norm(device: &CudaDevice, t: usize, h: usize, copy_rate: f64) {
    let bf = 2.0;
    let x = rand([t, h], device);
    let r = rand([t, h], device);
    let g = rand([h], device);
    let dy = rand([t, h], device);
    let n = (t * h) as f64;
    let named = |what: &str| format!("{what} [{t},{h}]");
    line(&named("kiln rms_norm fwd bf16"), time(device, ITERS, || ops::rms_norm(x.clone(), g.clone(), 1e-6)), 2.0 * n * bf, copy_rate);
    line(&named("kiln rms_norm+residual fwd bf16"), time(device, ITERS, || ops::rms_norm_residual(x.clone(), r.clone(), g.clone(), 1e-6)), 4.0 * n * bf, copy_rate);
    let (xc, rc, gc, dyc) = (bf16::<Cube, 2>([t, h], device), bf16::<Cube, 2>([t, h], device), bf16::<Cube, 1>([h], device), bf16::<Cube, 2>([t, h], device));
    gpu_line(device, &named("kiln rms_norm fwd bf16"), 2.0 * n * bf, n * bf, || ops::rms_norm(xc.clone(), gc.clone(), 1e-6));
    gpu_line(device, &named("kiln rms_norm+residual fwd bf16"), 4.0 * n * bf, 2.0 * n * bf, || ops::rms_norm_residual(xc.clone(), rc.clone(), gc.clone(), 1e-6));
    let rstd_c = <Cube as kiln::ops::rms_norm::RmsNormBackend>::rms_norm_forward(xc.clone().into_primitive().tensor(), gc.clone().into_primitive().tensor(), None, 1e-6).rstd;
    gpu_line(device, &named("kiln rms_norm bwd bf16 (dx, dgamma)"), 3.0 * n * bf, n * bf, || {
        <Cube as kiln::ops::rms_norm::RmsNormBackend>::rms_norm_backward(xc.clone().into_primitive().tensor(), gc.clone().into_primitive().tensor(), rstd_c.clone(), dyc.clone().into_primitive().tensor())
    });
    drop((xc, rc, gc, dyc, rstd_c));
    let burn_norm = burn::nn::RmsNormConfig::new(h).with_epsilon(1e-6).init::<B>(device);
    let burn_norm = burn::nn::RmsNorm { gamma: burn::module::Param::from_tensor(g.clone()), ..burn_norm };
    line(&named("burn nn::RmsNorm fwd bf16"), time(device, ITERS, || burn_norm.forward(x.clone())), 2.0 * n * bf, copy_rate);
    let fwd = <B as kiln::ops::rms_norm::RmsNormBackend>::rms_norm_forward(x.clone().into_primitive().tensor(), g.clone().into_primitive().tensor(), None, 1e-6);
    let rstd = fwd.rstd;
    line(&named("kiln rms_norm bwd bf16 (dx, dgamma)"), time(device, ITERS, || {
        <B as kiln::ops::rms_norm::RmsNormBackend>::rms_norm_backward(x.clone().into_primitive().tensor(), g.clone().into_primitive().tensor(), rstd.clone(), dy.clone().into_primitive().tensor())
    }), 3.0 * n * bf, copy_rate);
    let xa = Tensor::<Ad, 2>::from_inner(x.clone()).require_grad();
    let ga = Tensor::<Ad, 1>::from_inner(g.clone()).require_grad();
    let dya = Tensor::<Ad, 2>::from_inner(dy.clone());
    line(&named("loss ops alone (Σ y·dy fwd+bwd, autodiff) bf16"), time(device, ITERS, || (xa.clone() * dya.clone()).sum().backward()), 3.0 * n * bf, copy_rate);
    line(&named("kiln rms_norm fwd+bwd (autodiff) bf16"), time(device, ITERS, || (ops::rms_norm(xa.clone(), ga.clone(), 1e-6) * dya.clone()).sum().backward()), 5.0 * n * bf, copy_rate);
    let burn_norm_ad = burn::nn::RmsNorm::<Ad> { gamma: burn::module::Param::from_tensor(ga.clone()), epsilon: 1e-6 };
    line(&named("burn nn::RmsNorm fwd+bwd (autodiff) bf16"), time(device, ITERS, || (burn_norm_ad.forward(xa.clone()) * dya.clone()).sum().backward()), 5.0 * n * bf, copy_rate);
}

/// SwiGLU's forward, its backward's kernel and an autodiff step on `[16384, 11008]` bf16, beside
/// Burn's fused `silu(g) * u`.
fn bench_swiglu(device: &CudaDevice, copy_rate: f64) {
    let bf = 2.0;
    let (t, f) = (16384, 11008);
    let gate = rand([t, f], device);
    let up = rand([t, f], device);
    let dy = rand([t, f], device);
    let n = (t * f) as f64;
    line("kiln swiglu fwd bf16 [16384,11008]", time(device, ITERS, || ops::swiglu(gate.clone(), up.clone())), 3.0 * n * bf, copy_rate);
    line("burn silu(g)*u fwd bf16", time(device, ITERS, || activation::silu(gate.clone()) * up.clone()), 3.0 * n * bf, copy_rate);
    {
        let (gc, uc, dyc) = (bf16::<Cube, 2>([t, f], device), bf16::<Cube, 2>([t, f], device), bf16::<Cube, 2>([t, f], device));
        gpu_line(device, "kiln swiglu fwd bf16 [16384,11008]", 3.0 * n * bf, n * bf, || ops::swiglu(gc.clone(), uc.clone()));
        gpu_line(device, "kiln swiglu bwd bf16 (dg, du)", 5.0 * n * bf, 2.0 * n * bf, || {
            <Cube as kiln::ops::swiglu::SwiGluBackend>::glu_backward(gc.clone().into_primitive().tensor(), uc.clone().into_primitive().tensor(), dyc.clone().into_primitive().tensor(), GluActivation::Silu)
        });
    }
    line("kiln swiglu bwd bf16 (dg, du)", time(device, ITERS, || {
        <B as kiln::ops::swiglu::SwiGluBackend>::glu_backward(gate.clone().into_primitive().tensor(), up.clone().into_primitive().tensor(), dy.clone().into_primitive().tensor(), GluActivation::Silu)
    }), 5.0 * n * bf, copy_rate);
    let (ga, ua, dya) = (Tensor::<Ad, 2>::from_inner(gate.clone()).require_grad(), Tensor::<Ad, 2>::from_inner(up.clone()).require_grad(), Tensor::<Ad, 2>::from_inner(dy.clone()));
    line("loss ops alone (Σ y·dy fwd+bwd, autodiff) bf16", time(device, ITERS, || (ga.clone() * dya.clone()).sum().backward()), 3.0 * n * bf, copy_rate);
    line("kiln swiglu fwd+bwd (autodiff) bf16", time(device, ITERS, || (ops::swiglu(ga.clone(), ua.clone()) * dya.clone()).sum().backward()), 8.0 * n * bf, copy_rate);
    line("burn silu(g)*u fwd+bwd (autodiff) bf16", time(device, ITERS, || ((activation::silu(ga.clone()) * ua.clone()) * dya.clone()).sum().backward()), 8.0 * n * bf, copy_rate);
    drop((gate, up, dy, ga, ua, dya));
}

fn bench(device: &CudaDevice) {
    let bf = 2.0; // bytes per bf16 element
    let copy_rate = copy_rate(device);
    bench_rms_norm(device, 16384, 4096, copy_rate);
    bench_rms_norm(device, 4096, 2048, copy_rate);

    bench_swiglu(device, copy_rate);

    // RoPE and fused QK-norm + RoPE: q [4, 4096, 32, 128], k [4, 4096, 8, 128].
    let (b, s, hq, hk, d) = (4, 4096, 32, 8, 128);
    let table = RopeTable::<B>::new(d, s, 500_000.0, RopeScaling::None, device);
    let q = rand([b, s, hq, d], device);
    let k = rand([b, s, hk, d], device);
    let qg = rand([d], device);
    let nq = (b * s * hq * d) as f64;
    let nqk = (b * s * (hq + hk) * d) as f64;
    line("kiln rope fwd bf16 q[4,4096,32,128]", time(device, ITERS, || ops::rope(q.clone(), &table, 0)), 2.0 * nq * bf, copy_rate);
    let burn_rope = burn::nn::RotaryEncodingConfig::new(s, d).with_theta(500_000.0).init::<B>(device);
    // Burn's RotaryEncoding wants a contiguous [b, heads, seq, d] tensor (a swapped view panics)
    // and fails on bf16 input (DTypeMismatch against its f32 tables), so it runs in f32: 4 bytes
    // per element.
    let q_bhsd = rand([b, hq, s, d], device).cast(DType::F32);
    line("burn RotaryEncoding fwd f32 q[4,32,4096,128]", time(device, ITERS, || burn_rope.forward(q_bhsd.clone())), 2.0 * nq * 4.0, copy_rate);
    line("kiln rms_norm_rope fwd bf16 q+k", time(device, ITERS, || ops::rms_norm_rope(q.clone(), k.clone(), qg.clone(), qg.clone(), &table, 0, 1e-6)), 2.0 * nqk * bf, copy_rate);
    let fwd = <B as kiln::ops::rms_norm_rope::RmsNormRopeBackend>::rms_norm_rope_forward(
        q.clone().into_primitive().tensor(), k.clone().into_primitive().tensor(), qg.clone().into_primitive().tensor(), qg.clone().into_primitive().tensor(),
        table.cos().into_primitive().tensor(), table.sin().into_primitive().tensor(), 0, 1e-6);
    let dq = rand([b, s, hq, d], device);
    line("kiln rms_norm_rope bwd bf16 q", time(device, ITERS, || {
        <B as kiln::ops::rms_norm_rope::RmsNormRopeBackend>::rms_norm_rope_backward(q.clone().into_primitive().tensor(), qg.clone().into_primitive().tensor(), fwd.q_rstd.clone(), dq.clone().into_primitive().tensor(), table.cos().into_primitive().tensor(), table.sin().into_primitive().tensor(), 0)
    }), 3.0 * nq * bf, copy_rate);
}

/// HBM3 nominal bandwidth of the H100 SXM, bytes per second.
const HBM: f64 = 3.35e12;

/// A bf16 tensor of N(0, 1) values.
fn bf16<BK: Backend<Device = CudaDevice>, const D: usize>(shape: [usize; D], device: &CudaDevice) -> Tensor<BK, D> {
    Tensor::<BK, D>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(DType::BF16)
}

/// One decode-sized RMSNorm (`[1, 4096]` bf16, no residual) per call on `CubeBackend`: per call
/// time (median of three samples after one), for `cuda_trace.so` to count each call's launches.
/// Three ways: 2000 calls a sample with every output kept until the sync, 200 kept, and 2000 with
/// each output dropped as it is made. CubeCL's pool searches its pages on every reservation, so
/// the outputs a loop keeps alive may cost host time of their own.
fn bench_rms_norm_calls(device: &CudaDevice) {
    let x = Tensor::<Cube, 2>::random([1, 4096], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
    let g = Tensor::<Cube, 1>::random([4096], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
    for (calls, keep) in [(2000, true), (200, true), (2000, false)] {
        let mut times: Vec<f64> = (0..4)
            .map(|_| {
                let start = Instant::now();
                let outs: Vec<_> = (0..calls)
                    .filter_map(|_| {
                        let out = ops::rms_norm(x.clone(), g.clone(), 1e-6);
                        keep.then_some(out)
                    })
                    .collect();
                <Cube as Backend>::sync(device).unwrap();
                drop(outs);
                start.elapsed().as_secs_f64() / calls as f64
            })
            .collect();
        times.remove(0);
        times.sort_by(f64::total_cmp);
        let outputs = if keep { "kept to the sync" } else { "dropped at once" };
        println!("bench rms_norm [1, 4096] bf16 on CubeBackend, {calls} calls a sample, outputs {outputs}: {:.1} us/call", times[1] * 1e6);
    }
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    let device = CudaDevice::default();
    println!("kiln GPU check on {device:?}, mode {mode}");
    let mut ok = true;
    if mode == "parity" || mode == "all" {
        ok = parity(&device, &std::env::args().nth(2).unwrap_or_default());
        println!("parity: {}", if ok { "all passed" } else { "FAILURES" });
    }
    if mode == "bench" || mode == "all" {
        bench(&device);
    }
    if mode == "attention" || mode == "bench" || mode == "all" {
        attention::bench_attention(&device, false, false);
    }
    if mode == "parity-tensor-cores" {
        // Optional words: `f16` (bf16 otherwise), `forward` (no backward).
        let words: Vec<String> = std::env::args().skip(2).collect();
        let f16 = words.iter().any(|a| a == "f16");
        ok = attention::parity_tensor_cores(&device, if f16 { DType::F16 } else { DType::BF16 }, !words.iter().any(|a| a == "forward"));
    }
    if mode == "gemm-order" {
        ok = gemm::ordering_check(&device);
        gemm::bench_order(&device);
    }
    if mode == "gemm" || mode == "gemm-bf16" || mode == "gemm-quick" {
        gemm::bench(&device, DType::BF16, mode == "gemm-quick");
    }
    if mode == "gemm" || mode == "gemm-f32" {
        gemm::bench(&device, DType::F32, false);
    }
    if mode == "parity-skinny" {
        ok = gemm::parity_skinny(&device);
    }
    if mode == "gemm-skinny" {
        let ms: Vec<usize> = std::env::args().skip(2).filter_map(|a| a.parse().ok()).collect();
        gemm::bench_skinny(&device, &ms);
    }
    if mode == "gemm-skinny-kernels" {
        gemm::skinny_kernels(&device, std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(1));
    }
    if mode == "nf4" || mode == "nf4-gemv-parity" || mode == "all" {
        ok &= nf4::gemv_parity(&device);
    }
    if mode == "nf4" || mode == "nf4-gemm-parity" || mode == "all" {
        ok &= nf4::gemm_parity(&device);
    }
    if mode == "nf4" || mode == "all" {
        ok &= nf4::exact_quantization(&device);
    }
    if mode == "nf4" || mode == "nf4-bench" || mode == "bench" || mode == "all" {
        nf4::bench_gemv(&device);
        nf4::bench_prefill(&device);
        nf4::bench_qlora_step(&device);
    }
    if mode == "dora-bench" || mode == "bench" || mode == "all" {
        dora::bench_steps(&device);
    }
    if mode == "dora-rounds" {
        dora::bench_rounds(&device);
    }
    if mode == "lora-dy-parity" || mode == "all" {
        ok &= lora::dy_parity(&device);
    }
    if mode == "lora-linear-parity" || mode == "all" {
        ok &= lora::linear_parity(&device);
    }
    if mode == "lora-expand-parity" || mode == "all" {
        ok &= lora::expand_parity(&device);
    }
    if mode == "lora-trace" {
        lora::step_trace(&device, std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(100));
    }
    if mode == "lora-bench" || mode == "bench" || mode == "all" {
        lora::bench_steps(&device);
    }
    if mode == "qlora-bench" || mode == "bench" || mode == "all" {
        lora::bench_qlora_rounds(&device);
    }
    if mode == "ternary" || mode == "ternary-parity" || mode == "all" {
        ok &= ternary::parity(&device);
    }
    if mode == "ternary" || mode == "ternary-bench" || mode == "bench" || mode == "all" {
        ternary::bench_gemv(&device);
        ternary::bench_prefill(&device);
        ternary::bench_input_grad(&device);
        ternary::bench_qat_step(&device);
        ternary::bench_relu2_glu(&device);
    }
    if mode == "ternary-gemv" {
        ternary::bench_gemv(&device);
    }
    if mode == "ternary-prefill" {
        ternary::bench_prefill(&device);
    }
    if mode == "ternary-prefill-once" {
        ternary::prefill_once(&device);
    }
    if mode == "ternary-grad" {
        ternary::bench_input_grad(&device);
    }
    if mode == "ternary-qat" {
        ternary::bench_qat_step(&device);
    }
    if mode == "cross-entropy" || mode == "bench" || mode == "all" {
        cross_entropy::bench(&device);
    }
    if mode == "linear-cross-entropy" || mode == "bench" || mode == "all" {
        linear_cross_entropy::bench(&device);
    }
    if mode == "trit" || mode == "all" {
        ok &= trit::parity(&device);
    }
    if mode == "trit" || mode == "trit-bench" || mode == "bench" || mode == "all" {
        trit::bench(&device);
    }
    if mode == "trit-layout" {
        trit::layout(&device);
    }
    if mode == "sketch" || mode == "all" {
        ok &= sketch::parity(&device);
    }
    if mode == "sketch" || mode == "sketch-bench" || mode == "bench" || mode == "all" {
        sketch::bench(&device);
    }
    if mode == "nf4-prefill" {
        nf4::bench_prefill(&device);
    }
    if mode == "nf4-gemv" {
        nf4::bench_gemv(&device);
    }
    if mode == "rms-norm" {
        let copy_rate = copy_rate(&device);
        bench_rms_norm(&device, 16384, 4096, copy_rate);
        bench_rms_norm(&device, 4096, 2048, copy_rate);
    }
    if mode == "glu" {
        bench_swiglu(&device, copy_rate(&device));
    }
    if mode == "rms-norm-calls" {
        bench_rms_norm_calls(&device);
    }
    if mode == "host-profile" {
        host_profile::run(&device, &std::env::args().skip(2).collect::<Vec<_>>());
    }
    if mode == "gemm-host" {
        gemm::bench_host(&device);
    }
    if mode == "gemm-linear" {
        gemm::bench_linear(&device);
    }
    if mode == "gemm-strategies" {
        gemm::bench_strategies(&device);
    }
    if mode == "attention-probe" {
        attention::attention_probe(&device);
    }
    if mode == "attention-decode" {
        attention::bench_decode(&device);
    }
    if mode == "attention-fwd" {
        attention::bench_attention(&device, false, true);
    }
    if mode == "attention-quick" {
        attention::bench_attention(&device, true, false);
    }
    std::process::exit(if ok { 0 } else { 1 });
}
