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
use clap::Parser;
use kiln::KilnBackend;
use kiln::nn::LinearLayer;
use kiln_models::model::Decoder;
use kiln_models::model::build::build;
use kiln_models::runtime::{OnBackend, dispatch};
use kiln_models::{BitNetOptions, to_bitnet};

#[path = "common/steps.rs"]
mod common;
#[path = "common/pool.rs"]
mod pool;
use common::{StepArgs, exit_on_error, preset, train_steps};

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
    /// BitLinears without their own input RMSNorm (as HF's `BitNetForCausalLM`, whose sub-norms
    /// sit in the decoder instead).
    #[arg(long)]
    no_input_norm: bool,
    #[command(flatten)]
    run: StepArgs,
}

impl OnBackend for Args {
    type Output = ();

    fn run<B: KilnBackend>(self, device: B::Device, name: &str) {
        let (config, mut weights) = preset("qat_step", &self.shape, self.seq, &self.run);
        let kind = match (self.float, self.no_input_norm) {
            (true, _) => "float linears",
            (false, false) => "BitNet b1.58 QAT linears (BitLinear)",
            (false, true) => "BitNet b1.58 QAT linears (BitLinear) without their input norms",
        };
        println!("qat_step {} on {name}, {:?}: {kind}, AdamW on every parameter, batch {} x {}", self.shape, weights.dtype, self.batch, self.seq);
        let result = build::<Autodiff<B>, _, _>(&config, &mut weights, &device, |_, l| l).map(|model| {
            if self.float {
                steps(&self, model, &device)
            } else {
                let options = BitNetOptions { input_norm: !self.no_input_norm, ..BitNetOptions::default() };
                steps(&self, to_bitnet(model, options), &device)
            }
        });
        exit_on_error("qat_step", result);
    }
}

/// The whole model's training steps, every parameter trainable.
fn steps<B, L>(args: &Args, model: Decoder<Autodiff<B>, L>, device: &B::Device)
where
    B: KilnBackend,
    L: LinearLayer<Autodiff<B>> + AutodiffModule<Autodiff<B>> + 'static,
    L::InnerModule: LinearLayer<B>,
{
    println!("model: {} parameters, all trainable", model.num_params());
    let label = if args.float { "qat_step (float)" } else { "qat_step (BitNet QAT)" };
    train_steps(label, &args.run, [args.batch, args.seq], model, device);
}

fn main() {
    let args = Args::parse();
    if let Err(message) = dispatch(&args.run.device.clone(), args) {
        eprintln!("qat_step: {message}");
        std::process::exit(2);
    }
}
