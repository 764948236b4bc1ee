//! What the training-step examples (`qlora_step`, `qat_step`) share: a fixed token batch and the
//! timed loop of full steps.

use std::time::Instant;

use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use kiln::KilnBackend;
use kiln_models::train::LmBatch;

/// The arguments every training-step example takes besides its model and batch.
#[derive(clap::Args, Debug, Clone)]
pub struct StepArgs {
    /// Untimed steps first (kernel compilation, autotuning, memory pools).
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 6)]
    pub steps: usize,
    /// bf16 (default) or f32 (the CPU backend has no bf16).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// auto, cuda, wgpu or cpu.
    #[arg(long, default_value = "auto")]
    pub device: String,
}

impl StepArgs {
    pub fn float_dtype(&self) -> FloatDType {
        if self.dtype == "f32" { FloatDType::F32 } else { FloatDType::BF16 }
    }
}

/// Inputs from a fixed pseudo-random sequence, each target the next input (as a causal LM trains).
pub fn token_batch<B: KilnBackend>(batch: usize, seq: usize, vocab: usize, device: &B::Device) -> LmBatch<B> {
    let ids: Vec<i64> = (0..batch * (seq + 1)).map(|i| ((i * 7919 + 13) % vocab) as i64).collect();
    let all = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq + 1]), device);
    LmBatch { inputs: all.clone().narrow(1, 0, seq), targets: all.narrow(1, 1, seq), mask: None }
}

/// `warmup` untimed and `steps` timed calls of `step` (one training step, its loss read back);
/// prints each timed step, then `kiln {label} median … ms, … tokens/s` for `tokens` a step.
pub fn timed_steps(label: &str, warmup: usize, steps: usize, tokens: usize, mut step: impl FnMut() -> f64) {
    let mut times = Vec::with_capacity(steps);
    for i in 0..warmup + steps {
        let start = Instant::now();
        let loss = step();
        let seconds = start.elapsed().as_secs_f64();
        if i >= warmup {
            println!("step {}: {:.2} ms, loss {loss:.4}", i - warmup, seconds * 1e3);
            times.push(seconds);
        }
    }
    times.sort_by(f64::total_cmp);
    if let Some(&median) = times.get(times.len() / 2) {
        println!("kiln {label} median {:.2} ms, {:.0} tokens/s", median * 1e3, tokens as f64 / median);
    }
}
