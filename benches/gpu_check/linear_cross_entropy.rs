//! The fused linear cross-entropy on CUDA: parity (the loss and both gradients against composed
//! Burn ops, chunked and whole), and a language model's head and loss timed fused and unfused
//! (`ops::linear` + `ops::cross_entropy`), with the weight trained and frozen (QLoRA), and the
//! memory each keeps for its backward (`benches/peers/linear_cross_entropy.py` runs torch and
//! Liger-Kernel's fused linear cross-entropy at the same shapes in the same call).

use burn::backend::cuda::CudaDevice;
use burn::tensor::{Int, Tensor};
use kiln::ops::{self, linear_cross_entropy::{LinearCrossEntropyOptions, Reduction}};

use super::common::checks::LinearCrossEntropyCase;
use super::{Ad, B, bf16, held_by, time_adaptive};

/// `(rows, hidden, vocab)`: Llama-3.2-1B at 4 × 2048 tokens, Llama-3-8B at 2 × 2048, Qwen2.5-7B at
/// 2 × 2048.
const SHAPES: [(usize, usize, usize); 3] = [(8192, 2048, 128_256), (4096, 4096, 128_256), (4096, 3584, 152_064)];

/// Calls a timed sample keeps alive (each holds a weight-sized gradient); `time_adaptive` takes
/// at least three.
const STEP_CALLS: usize = 3;

pub fn parity_cases() -> Vec<LinearCrossEntropyCase> {
    let case = |rows, d, vocab, chunk_rows, tied, seed| LinearCrossEntropyCase { rows, d, vocab, chunk_rows, reduction: Reduction::Mean, tied, ignore_every: 3, seed };
    // Small products: the reference's Burn matmul autotunes every new shape (300 × 256 × 32000 took
    // two minutes in the 42nd session's first call).
    vec![case(70, 64, 32_000, Some(32), true, 30), case(33, 128, 128_256, None, false, 31)]
}

fn row(name: &str, seconds: f64, held: Option<f64>) {
    let held = held.map_or(String::new(), |h| format!("  holds {:.1} MB for the backward", h / 1e6));
    println!("bench {name:<72} {:>8.3} ms{held}", seconds * 1e3);
}

/// The unfused loss: the logits by kiln's GEMM, then kiln's cross-entropy, mean over counted rows.
fn unfused(h: Tensor<Ad, 2>, w: Tensor<Ad, 2>, t: Tensor<Ad, 1, Int>) -> Tensor<Ad, 1> {
    let counted = t.clone().greater_equal_elem(0).float().sum().clamp_min(1.0);
    ops::cross_entropy(ops::linear(h, w, None), t).sum() / counted
}

fn fused(h: Tensor<Ad, 2>, w: Tensor<Ad, 2>, t: Tensor<Ad, 1, Int>) -> Tensor<Ad, 1> {
    chunked(h, w, t, None)
}

fn chunked(h: Tensor<Ad, 2>, w: Tensor<Ad, 2>, t: Tensor<Ad, 1, Int>, chunk_rows: Option<usize>) -> Tensor<Ad, 1> {
    ops::linear_cross_entropy(h, w, t, LinearCrossEntropyOptions { chunk_rows, ..Default::default() })
}

/// The trained weight at other chunk lengths than the default: each chunk past the first adds a
/// pass over `dW`, and each row of a chunk holds a row of logits and of their gradient.
fn trained_chunks(device: &CudaDevice, h: &Tensor<Ad, 2>, w: &Tensor<Ad, 2>, t: &Tensor<Ad, 1, Int>, shape: &str) {
    let rows = h.dims()[0];
    for chunk in [1024, 2048, 4096, rows] {
        let held = held_by(device, || chunked(h.clone(), w.clone(), t.clone(), Some(chunk))).0;
        let step = time_adaptive(device, 0.3, STEP_CALLS, || chunked(h.clone(), w.clone(), t.clone(), Some(chunk)).backward());
        row(&format!("kiln linear_cross_entropy fwd+bwd, weight trained, {chunk} rows a chunk {shape}"), step, Some(held));
    }
}

pub fn bench(device: &CudaDevice) {
    for (rows, d, vocab) in SHAPES {
        let shape = format!("[{rows}, {d}] x [{d}, {vocab}] bf16");
        let h = Tensor::<Ad, 2>::from_inner(bf16::<B, 2>([rows, d], device)).require_grad();
        // The weight as a tied embedding (and Liger) stores it, `[vocab, d]`, entering transposed.
        let stored = Tensor::<Ad, 2>::from_inner(bf16::<B, 2>([vocab, d], device).mul_scalar(0.05));
        let t = Tensor::<Ad, 1, Int>::from_inner(super::cross_entropy::targets(rows, vocab, device).0);
        let (trained, frozen) = (stored.clone().require_grad().transpose(), stored.clone().transpose());
        let loss = time_adaptive(device, 0.3, 10, || ops::linear_cross_entropy(h.clone().inner(), frozen.clone().inner(), t.clone().inner(), Default::default()));
        row(&format!("kiln linear_cross_entropy loss only {shape}"), loss, None);
        for (weight, w) in [("trained", &trained), ("frozen", &frozen)] {
            let held = held_by(device, || fused(h.clone(), w.clone(), t.clone())).0;
            let step = time_adaptive(device, 0.3, STEP_CALLS, || fused(h.clone(), w.clone(), t.clone()).backward());
            row(&format!("kiln linear_cross_entropy fwd+bwd, weight {weight} {shape}"), step, Some(held));
            let held = held_by(device, || unfused(h.clone(), w.clone(), t.clone())).0;
            let step = time_adaptive(device, 0.3, STEP_CALLS, || unfused(h.clone(), w.clone(), t.clone()).backward());
            row(&format!("kiln linear + cross_entropy fwd+bwd, weight {weight} {shape}"), step, Some(held));
        }
        trained_chunks(device, &h, &trained, &t, &shape);
        let (a, b) = (fused(h.clone(), trained.clone(), t.clone()).into_scalar() as f64, unfused(h.clone(), trained.clone(), t.clone()).into_scalar() as f64);
        println!("bench linear_cross_entropy {shape} mean loss fused {a:.6} unfused {b:.6} (|diff| {:.2e})", (a - b).abs());
    }
}
