//! The QLoRA fine-tune's training step at a real checkpoint's shape, without the checkpoint: random
//! weights of `--shape` (default Llama-3.2-1B) quantized to NF4 as `examples/qlora.rs` loads them
//! (block 64, double quantization), LoRA on every attention and MLP linear, and full steps on a
//! `[batch, seq]` token batch: forward, the f32 cross-entropy over every position, backward, AdamW
//! on the adapters, the loss read back. Prints the median step time and tokens/s; the GPU check
//! runs it next to `benches/peers/qlora_step.py` (transformers + bitsandbytes + PEFT), which also
//! reads both processes' peak device memory.
//!
//! `cargo run --release -p kiln-models --features cuda --example qlora_step -- --batch 4 --seq 2048`
//! (`--shape tiny --device cpu --dtype f32` for a smoke run).

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use clap::Parser;
use kiln::KilnBackend;
use kiln::nn::{LinearLayer, LoraConfig};
use kiln_models::adapter::{LoraDecoder, Targets, add_lora};
use kiln_models::model::build::build;
use kiln_models::runtime::{OnBackend, dispatch};
use kiln_models::{Nf4Maker, build_with};

#[path = "common/steps.rs"]
mod common;
#[path = "common/pool.rs"]
mod pool;
use common::{StepArgs, exit_on_error, preset, train_steps};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// qwen2.5-0.5b, llama3.2-1b or tiny.
    #[arg(long, default_value = "llama3.2-1b")]
    shape: String,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    #[arg(long, default_value_t = 16)]
    rank: usize,
    #[arg(long, default_value_t = 32.0)]
    alpha: f64,
    /// Keep the base in float (LoRA) instead of NF4 (QLoRA).
    #[arg(long)]
    float: bool,
    #[command(flatten)]
    run: StepArgs,
}

impl OnBackend for Args {
    type Output = ();

    fn run<B: KilnBackend>(self, device: B::Device, name: &str) {
        let (config, mut weights) = preset("qlora_step", &self.shape, self.seq, &self.run);
        let lora = LoraConfig::new().with_rank(self.rank).with_alpha(self.alpha);
        let base = if self.float { "float" } else { "NF4 (block 64, double quantization)" };
        println!("qlora_step {} on {name}, {:?}: {} base, LoRA r {} alpha {} on all linears, batch {} x {}", self.shape, weights.dtype, base, self.rank, self.alpha, self.batch, self.seq);
        let result = if self.float {
            build::<Autodiff<B>, _, _>(&config, &mut weights, &device, |_, l| l).map(|m| steps(&self, add_lora(m, &lora, &Targets::AllLinear), &device))
        } else {
            build_with::<Autodiff<B>, _, _>(&config, &mut weights, &device, &mut Nf4Maker::default()).map(|m| steps(&self, add_lora(m, &lora, &Targets::AllLinear), &device))
        };
        exit_on_error("qlora_step", result);
    }
}

/// The adapters' training steps (the base frozen).
fn steps<B, L>(args: &Args, model: LoraDecoder<Autodiff<B>, L>, device: &B::Device)
where
    B: KilnBackend,
    L: LinearLayer<Autodiff<B>> + AutodiffModule<Autodiff<B>> + 'static,
    L::InnerModule: LinearLayer<B>,
{
    let trainable: usize = model.linears().iter().filter_map(|(_, l)| l.adapter.as_ref()).map(|a| a.num_params()).sum();
    println!("model: {} parameters, {trainable} trainable", model.num_params());
    train_steps("qlora_step", &args.run, [args.batch, args.seq], model, device);
}

fn main() {
    let args = Args::parse();
    if let Err(message) = dispatch(&args.run.device.clone(), args) {
        eprintln!("qlora_step: {message}");
        std::process::exit(2);
    }
}
