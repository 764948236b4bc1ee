//! Ternary gradient sketches on the H100: compress and decompress against the host definition
//! (bit for bit; sums of squares within a rounding per term), the fused sketched-AdamW step
//! against its reference composition, the sketched AdamW at ratio 1 against Burn's AdamW, and
//! timings at a Llama-7B MLP weight (4096 × 11008): compress + decompress, and an optimizer step
//! next to AdamW's, with the state memory; torch's count sketch (stored index map, `index_add_`) and fused AdamW run in
//! `peers/sketch.py` in the same call.

use std::time::Instant;

use burn::backend::cuda::CudaDevice;
use burn::optim::{AdamWConfig, SimpleOptimizer};
use burn::tensor::{DType, Distribution, Tensor};
use kiln::ops::sketch::{self, Sketch};
use kiln::optim::SketchedAdamWConfig;

use super::B;
use super::common::sketches::check_step;

/// Values of the timed parameter (a Llama-7B MLP weight).
const N: usize = 4096 * 11008;

fn bits(t: Tensor<B, 1>) -> Vec<u32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// Compress (signed and of squares) and decompress (signed and not) equal the host's bit for bit.
pub fn parity(device: &CudaDevice) -> bool {
    let mut ok = true;
    for (n, r) in [(1, 1), (1000, 3), (1_000_003, 4), (16_777_221, 8)] {
        let s = Sketch::new(n, r, 17).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let g = Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 1.0), device).cast(dtype);
            let host: Vec<f32> = g.clone().into_data().convert::<f32>().into_vec().unwrap();
            let c = sketch::compress(g.clone(), &s);
            let got: Vec<f32> = c.clone().into_data().into_vec().unwrap();
            let same = |a: Vec<u32>, b: &[f32]| a == b.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let squares: Vec<f32> = (0..s.compressed())
                .map(|b| (b * r..((b + 1) * r).min(n)).fold(0f32, |sum, p| sum + host[s.column(p)] * host[s.column(p)]))
                .collect();
            let checks = [
                ("compress", same(bits(c.clone()), &s.compress(&host))),
                ("compress squares (within a rounding per term: CUDA fuses x·x + sum)", {
                    let got: Vec<f32> = sketch::compress_squares(g, &s).into_data().into_vec().unwrap();
                    got.iter().zip(&squares).all(|(a, b)| (a - b).abs() <= r as f32 * f32::EPSILON * b.abs())
                }),
                ("decompress", same(bits(sketch::decompress(c.clone(), &s, DType::F32)), &s.decompress(&got, true))),
                ("unsigned decompress", same(bits(sketch::decompress_unsigned(c, &s, DType::F32)), &s.decompress(&got, false))),
            ];
            for (name, pass) in checks {
                ok &= pass;
                println!("parity sketch n {n} ratio {r} {dtype:?} {name}: {}", if pass { "ok" } else { "FAIL" });
            }
        }
    }
    let fused = std::panic::catch_unwind(|| check_step::<B>(device, &[(1, 1), (1000, 3), (1_000_003, 4)], &[DType::F32, DType::BF16]));
    ok &= fused.is_ok();
    println!("parity sketched AdamW fused step vs its reference composition, 3 steps, f32 and bf16: {}", if fused.is_ok() { "ok" } else { "FAIL" });
    let sketched = SketchedAdamWConfig::new().with_ratio(1).with_weight_decay(0.01).build();
    let adamw = AdamWConfig::new().with_weight_decay(0.01).build();
    let mut w = (Tensor::<B, 2>::random([64, 999], Distribution::Normal(0.0, 1.0), device), None);
    let mut v = (w.0.clone(), None);
    for _ in 0..5 {
        let g = Tensor::<B, 2>::random([64, 999], Distribution::Normal(0.0, 1.0), device);
        w = SimpleOptimizer::<B>::step(&sketched, 1e-2, w.0, g.clone(), w.1);
        v = adamw.step(1e-2, v.0, g, v.1);
    }
    let worst = (w.0 - v.0).abs().max().into_scalar();
    let pass = worst < 1e-5;
    ok &= pass;
    println!("parity sketched AdamW at ratio 1 vs AdamW, 5 steps: max |Δw| {worst:.2e} {}", if pass { "ok" } else { "FAIL" });
    ok
}

/// Seconds per optimizer step, state carried from step to step.
fn step_time<O: SimpleOptimizer<B>>(device: &CudaDevice, optim: &O, w: Tensor<B, 2>, g: Tensor<B, 2>) -> f64 {
    let mut state = (w, None);
    for _ in 0..3 {
        state = optim.step(1e-3, state.0, g.clone(), state.1);
    }
    super::sync_all(device);
    let steps = 30;
    let start = Instant::now();
    for _ in 0..steps {
        state = optim.step(1e-3, state.0, g.clone(), state.1);
    }
    super::sync_all(device);
    start.elapsed().as_secs_f64() / steps as f64
}

pub fn bench(device: &CudaDevice) {
    let g = Tensor::<B, 1>::random([N], Distribution::Normal(0.0, 1.0), device);
    for r in [2, 4, 16] {
        let s = Sketch::new(N, r, 3).unwrap();
        let compress = super::time_adaptive(device, 0.3, 100, || sketch::compress(g.clone(), &s));
        let c = sketch::compress(g.clone(), &s);
        let decompress = super::time_adaptive(device, 0.3, 100, || sketch::decompress(c.clone(), &s, DType::F32));
        println!(
            "bench sketch n {N} ratio {r}: compress {:.3} ms ({:.0} GB/s of f32 in), decompress {:.3} ms ({:.0} GB/s of f32 out)",
            compress * 1e3,
            4.0 * N as f64 / compress / 1e9,
            decompress * 1e3,
            4.0 * N as f64 / decompress / 1e9
        );
    }
    // The step alone on the flat parameter: the fused kernels against the composition they
    // replace (two compressions, two decompressions and elementwise ops), state not carried.
    for r in [4, 16] {
        let s = Sketch::new(N, r, 3).unwrap();
        let w = Tensor::<B, 1>::random([N], Distribution::Normal(0.0, 0.02), device);
        let moments = [(); 2].map(|_| Tensor::<B, 1>::random([s.compressed()], Distribution::Uniform(0.0, 1.0), device));
        let scalars = sketch::AdamWScalars::new(0.9, 0.999, 1e-8, 0.01, 1e-3, 10, r);
        let fused = super::time_adaptive(device, 0.3, 100, || sketch::adamw_step(w.clone(), g.clone(), moments.clone(), &s, scalars).0);
        let composed = super::time_adaptive(device, 0.3, 100, || {
            let [w, ..] = sketch::reference::adamw_step::<B>(w.clone().into_primitive().tensor(), g.clone().into_primitive().tensor(), moments.clone().map(|t| t.into_primitive().tensor()), s, scalars);
            Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(w))
        });
        println!(
            "bench sketched AdamW step n {N} ratio {r}: fused {:.3} ms, composed (compress ×2, decompress ×2, elementwise) {:.3} ms ({:.2}× faster)",
            fused * 1e3,
            composed * 1e3,
            composed / fused
        );
    }
    let w = Tensor::<B, 2>::random([4096, 11008], Distribution::Normal(0.0, 0.02), device);
    let g2 = Tensor::<B, 2>::random([4096, 11008], Distribution::Normal(0.0, 1.0), device);
    let adamw = step_time(device, &AdamWConfig::new().build(), w.clone(), g2.clone());
    println!("bench optimizer step [4096, 11008] f32: Burn AdamW {:.3} ms, state {:.1} MB", adamw * 1e3, 8.0 * N as f64 / 1e6);
    for r in [2, 4, 16] {
        let optim = SketchedAdamWConfig::new().with_ratio(r).build();
        let t = step_time(device, &optim, w.clone(), g2.clone());
        println!(
            "bench optimizer step [4096, 11008] f32: sketched AdamW ratio {r} {:.3} ms ({:.2}x AdamW's time), state {:.1} MB ({:.1} MB saved)",
            t * 1e3,
            t / adamw,
            optim.state_bytes(N) as f64 / 1e6,
            (8 * N - optim.state_bytes(N)) as f64 / 1e6
        );
    }
}
