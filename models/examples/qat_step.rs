//! A BitNet b1.58 quantization-aware training step at a real checkpoint's shape, next to the same
//! model trained in full precision: random weights of `--shape` (default Llama-3.2-1B), every
//! attention and MLP linear a `BitLinear` (`to_bitnet`: latent weights, ternary forward,
//! straight-through gradients, the RMSNorm before the activation quantization), or with `--float`
//! the float model as built; full steps on a `[batch, seq]` token batch: forward, the f32
//! cross-entropy over every position, backward, AdamW on every parameter, the loss read back.
//! Prints the median step time and tokens/s; the GPU check runs both in separate processes and
//! reads each one's peak device memory (`benches/peers/qat_step.py`).
//!
//! `cargo run --release -p kiln-models --features cuda --example qat_step -- --batch 2 --seq 2048`
//! (`--shape tiny --device cpu --dtype f32` for a smoke run).

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::ElementConversion;
use clap::Parser;
use kiln::KilnBackend;
use kiln::nn::LinearLayer;
use kiln_models::loader::RandomInit;
use kiln_models::model::Decoder;
use kiln_models::model::build::build;
use kiln_models::runtime::{OnBackend, dispatch};
use kiln_models::{BitNetOptions, DecoderConfig, to_bitnet};

#[path = "common/steps.rs"]
mod common;
use common::{StepArgs, timed_steps, token_batch};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// qwen2.5-0.5b, llama3.2-1b, bitnet-2b or tiny.
    #[arg(long, default_value = "llama3.2-1b")]
    shape: String,
    #[arg(long, default_value_t = 2)]
    batch: usize,
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Train the float model (the comparison) instead of its BitNet QAT form.
    #[arg(long)]
    float: bool,
    #[command(flatten)]
    run: StepArgs,
}

impl OnBackend for Args {
    type Output = ();

    fn run<B: KilnBackend>(self, device: B::Device, name: &str) {
        let Some(config) = DecoderConfig::preset(&self.shape) else {
            eprintln!("qat_step: unknown --shape {} (qwen2.5-0.5b, llama3.2-1b, bitnet-2b, tiny)", self.shape);
            std::process::exit(2);
        };
        let config = config.with_max_positions(self.seq);
        let dtype = self.run.float_dtype();
        let mut weights = RandomInit { std: 0.02, dtype };
        let kind = if self.float { "float linears" } else { "BitNet b1.58 QAT linears (BitLinear)" };
        println!("qat_step {} on {name}, {dtype:?}: {kind}, AdamW on every parameter, batch {} x {}", self.shape, self.batch, self.seq);
        let result = build::<Autodiff<B>, _, _>(&config, &mut weights, &device, |_, l| l).map(|model| {
            if self.float {
                steps(&self, model, &device)
            } else {
                steps(&self, to_bitnet(model, BitNetOptions::default()), &device)
            }
        });
        if let Err(e) = result {
            eprintln!("qat_step: {e}");
            std::process::exit(1);
        }
    }
}

/// `args.run.warmup` untimed and `args.run.steps` timed training steps of the whole model.
fn steps<B, L>(args: &Args, model: Decoder<Autodiff<B>, L>, device: &B::Device)
where
    B: KilnBackend,
    L: LinearLayer<Autodiff<B>> + AutodiffModule<Autodiff<B>> + 'static,
    L::InnerModule: LinearLayer<B>,
{
    println!("model: {} parameters, all trainable", model.num_params());
    let batch = token_batch::<Autodiff<B>>(args.batch, args.seq, model.config.vocab_size, device);
    let mut optim = AdamWConfig::new().with_weight_decay(0.0).init::<Autodiff<B>, Decoder<Autodiff<B>, L>>();
    let label = if args.float { "qat_step (float)" } else { "qat_step (BitNet QAT)" };
    let mut model = Some(model);
    timed_steps(label, args.run.warmup, args.run.steps, args.batch * args.seq, || {
        let current = model.take().expect("the model between steps");
        let loss = current.lm_loss(batch.clone()).loss;
        let grads = GradientsParams::from_grads(loss.backward(), &current);
        model = Some(optim.step(1e-4, current, grads));
        loss.into_scalar().elem::<f64>()
    });
}

fn main() {
    let args = Args::parse();
    if let Err(message) = dispatch(&args.run.device.clone(), args) {
        eprintln!("qat_step: {message}");
        std::process::exit(2);
    }
}
