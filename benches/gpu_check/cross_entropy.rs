//! Cross-entropy on CUDA: parity at vocabulary widths, and the loss of a language model's
//! batch (fused forward, forward + backward, the logits' memory kept for the backward) next to
//! the composed Burn ops kiln's training loss used before (`benches/peers/cross_entropy.py` times
//! torch and Liger-Kernel at the same shapes in the same call).

use burn::tensor::{FloatDType, Int, Tensor, TensorData, activation};
use burn::backend::cuda::CudaDevice;
use kiln::ops;

use super::common::checks::CrossEntropyCase;
use super::{Ad, B, HBM, bf16, held_by, time_adaptive};

/// `[rows, vocab]`: Llama-3's 128k vocabulary at 4 × 2048 tokens, Qwen2.5's 152k at 4096, and
/// Llama-2's 32k at 16384.
const SHAPES: [(usize, usize); 3] = [(8192, 128_256), (4096, 151_936), (16_384, 32_000)];

/// Calls a timed sample of forward + backward keeps alive: each holds the logits' gradient, and
/// more than the warm-up calls left in CubeCL's pool made the samples allocate (10 a sample took
/// three times as long at 151936 classes, 41st session's first call, and ran out of memory).
const STEP_CALLS: usize = 3;

pub fn parity_cases() -> Vec<CrossEntropyCase> {
    [(37, 1001, 1.0), (5, 128_256, 4.0), (300, 32_000, 8.0), (64, 151_936, 2.0)]
        .into_iter()
        .enumerate()
        .map(|(i, (rows, width, scale))| CrossEntropyCase { rows, width, scale, ignore_every: 3, seed: 20 + i as u64 })
        .collect()
}

/// Targets spread over the vocabulary, every tenth ignored (−100).
pub(super) fn targets(rows: usize, vocab: usize, device: &CudaDevice) -> (Tensor<B, 1, Int>, usize) {
    let values: Vec<i64> = (0..rows).map(|r| if r % 10 == 3 { -100 } else { ((r as u64 * 2_654_435_761) % vocab as u64) as i64 }).collect();
    let counted = values.iter().filter(|&&t| t >= 0).count();
    (Tensor::from_data(TensorData::new(values, [rows]), device), counted)
}

/// The mean loss over counted rows as the composed Burn ops compute it (kiln-models' loss before
/// the fused op): log-softmax of an f32 copy, the target's entry picked.
fn composed(logits: Tensor<Ad, 2>, targets: Tensor<Ad, 1, Int>, counted: f64) -> Tensor<Ad, 1> {
    let rows = targets.dims()[0];
    let keep = targets.clone().greater_equal_elem(0).float().cast(FloatDType::F32);
    let log_probs = activation::log_softmax(logits.cast(FloatDType::F32), 1);
    let picked = log_probs.gather(1, targets.clamp_min(0).reshape([rows, 1])).reshape([rows]);
    (picked * keep).sum().neg() / counted
}

/// The fused op's mean loss over counted rows.
fn fused(logits: Tensor<Ad, 2>, targets: Tensor<Ad, 1, Int>, counted: f64) -> Tensor<Ad, 1> {
    ops::cross_entropy(logits, targets).sum() / counted
}

fn row(name: &str, seconds: f64, bytes: f64, held: Option<f64>) {
    let held = held.map_or(String::new(), |h| format!("  holds {:.1} MB for the backward", h / 1e6));
    println!("bench {name:<60} {:>8.3} ms {:>6.0} GB/s {:>5.1}% of HBM{held}", seconds * 1e3, bytes / seconds / 1e9, 100.0 * bytes / seconds / HBM);
}

pub fn bench(device: &CudaDevice) {
    for (rows, vocab) in SHAPES {
        let logits = bf16::<B, 2>([rows, vocab], device).mul_scalar(2.0);
        let (t, counted) = targets(rows, vocab, device);
        let counted = counted as f64;
        let bytes = (rows * vocab * 2) as f64;
        let shape = format!("[{rows}, {vocab}] bf16");
        let t_ad = Tensor::<Ad, 1, Int>::from_inner(t.clone());
        let z = Tensor::<Ad, 2>::from_inner(logits.clone()).require_grad();
        let fwd = time_adaptive(device, 0.3, 50, || ops::cross_entropy(logits.clone(), t.clone()).sum() / counted);
        row(&format!("kiln cross_entropy fwd {shape}"), fwd, bytes, None);
        let held = held_by(device, || fused(z.clone(), t_ad.clone(), counted)).0;
        let step = time_adaptive(device, 0.3, STEP_CALLS, || fused(z.clone(), t_ad.clone(), counted).backward());
        row(&format!("kiln cross_entropy fwd+bwd {shape}"), step, 3.0 * bytes, Some(held));
        let held = held_by(device, || composed(z.clone(), t_ad.clone(), counted)).0;
        let step = time_adaptive(device, 0.3, STEP_CALLS, || composed(z.clone(), t_ad.clone(), counted).backward());
        row(&format!("burn log_softmax(f32) + gather fwd+bwd {shape}"), step, 3.0 * bytes, Some(held));
        let (kiln, burn) = (fused(z.clone(), t_ad.clone(), counted), composed(z.clone(), t_ad.clone(), counted));
        let (kiln, burn) = (kiln.into_scalar() as f64, burn.into_scalar() as f64);
        println!("bench cross_entropy {shape} mean loss kiln {kiln:.6} composed {burn:.6} (|diff| {:.2e})", (kiln - burn).abs());
    }
}
