//! What the training-step examples (`qlora_step`, `qat_step`) share: the model's shape and random
//! weights, a fixed token batch and the timed loop of full training steps.

use std::fmt::Display;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{ElementConversion, FloatDType, Int, Tensor, TensorData};
use kiln::KilnBackend;
use kiln::nn::LinearLayer;
use kiln_models::DecoderConfig;
use kiln_models::loader::RandomInit;
use kiln_models::model::Decoder;
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

/// `shape`'s preset config with room for `seq` positions, and random weights (std 0.02) in the
/// run's dtype; an unknown shape ends the process, naming the presets.
pub fn preset(example: &str, shape: &str, seq: usize, run: &StepArgs) -> (DecoderConfig, RandomInit) {
    let Some(config) = DecoderConfig::preset(shape) else {
        eprintln!("{example}: unknown --shape {shape} (qwen2.5-0.5b, llama3.2-1b, bitnet-2b, tiny)");
        std::process::exit(2);
    };
    (config.with_max_positions(seq), RandomInit { std: 0.02, dtype: run.float_dtype() })
}

/// Ends the process when building the model failed.
pub fn exit_on_error<E: Display>(example: &str, result: Result<(), E>) {
    if let Err(e) = result {
        eprintln!("{example}: {e}");
        std::process::exit(1);
    }
}

/// `run.warmup` untimed and `run.steps` timed full training steps of `model` on a `[batch, seq]`
/// token batch: forward, the f32 cross-entropy over every position, backward, AdamW (on whatever
/// the model leaves trainable), the loss read back.
pub fn train_steps<B, L>(label: &str, run: &StepArgs, [batch, seq]: [usize; 2], model: Decoder<Autodiff<B>, L>, device: &B::Device)
where
    B: KilnBackend,
    L: LinearLayer<Autodiff<B>> + AutodiffModule<Autodiff<B>> + 'static,
    L::InnerModule: LinearLayer<B>,
{
    let tokens = token_batch::<Autodiff<B>>(batch, seq, model.config.vocab_size, device);
    let mut optim = AdamWConfig::new().with_weight_decay(0.0).init::<Autodiff<B>, Decoder<Autodiff<B>, L>>();
    let mut model = Some(model);
    timed_steps(label, run.warmup, run.steps, batch * seq, || {
        let current = model.take().expect("the model between steps");
        let loss = current.lm_loss(tokens.clone()).loss;
        let grads = GradientsParams::from_grads(loss.backward(), &current);
        model = Some(optim.step(1e-4, current, grads));
        loss.into_scalar().elem::<f64>()
    });
    // What the steps left CubeCL's pool holding (the model and AdamW's state in use; the rest is
    // pages kept for the next step), beside the process's peak that the peer scripts read.
    println!("kiln {label} pool after the steps: {}", crate::pool::describe(crate::pool::pool_usage(device)));
}

/// Inputs from a fixed pseudo-random sequence, each target the next input (as a causal LM trains).
fn token_batch<B: KilnBackend>(batch: usize, seq: usize, vocab: usize, device: &B::Device) -> LmBatch<B> {
    let ids: Vec<i64> = (0..batch * (seq + 1)).map(|i| ((i * 7919 + 13) % vocab) as i64).collect();
    let all = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq + 1]), device);
    LmBatch { inputs: all.clone().narrow(1, 0, seq), targets: all.narrow(1, 1, seq), mask: None }
}

/// `warmup` untimed and `steps` timed calls of `step` (one training step, its loss read back);
/// prints each timed step, then `kiln {label} median … ms, … tokens/s` for `tokens` a step.
fn timed_steps(label: &str, warmup: usize, steps: usize, tokens: usize, mut step: impl FnMut() -> f64) {
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
