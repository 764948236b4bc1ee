//! Prefill and decode speed of a randomly initialized model of a real checkpoint's shape
//! (Qwen2.5-0.5B, Llama-3.2-1B, BitNet b1.58 2B, or a tiny one for a CPU smoke run): prefill
//! tokens/s at a context, then greedy decode tokens/s at batch 1 over that context, each step's
//! token read back as in real generation; `--ternary` packs the attention and MLP linears to
//! 2-bit ternary weights (W2A8 products). The GPU check runs it next to `benches/peers/decode.py`
//! (transformers).
//!
//! `cargo run --release -p kiln-models --features cuda --example decode_bench -- --shape qwen2.5-0.5b`

use std::time::Instant;

use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use clap::Parser;
use kiln::KilnBackend;
use kiln_models::loader::RandomInit;
use kiln_models::model::build::build;
use kiln_models::runtime::{OnBackend, dispatch};
use kiln_models::{Decoder, DecoderConfig, GenerationConfig, Projection, TernaryMaker, build_with};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// qwen2.5-0.5b, llama3.2-1b, bitnet-2b or tiny.
    #[arg(long, default_value = "qwen2.5-0.5b")]
    shape: String,
    /// Prompt length (prefill) and the context decoding runs over.
    #[arg(long, default_value_t = 2048)]
    context: usize,
    /// Tokens decoded after the prefill.
    #[arg(long, default_value_t = 128)]
    new: usize,
    /// Timed repetitions (the first run also warms up kernels and autotuning).
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// auto, cuda, wgpu or cpu.
    #[arg(long, default_value = "auto")]
    device: String,
    /// bf16 (default) or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Packed ternary attention and MLP linears (BitNet's W2A8) instead of float ones.
    #[arg(long)]
    ternary: bool,
}

impl OnBackend for Args {
    type Output = ();

    fn run<B: KilnBackend>(self, device: B::Device, name: &str) {
        let dtype = if self.dtype == "f32" { FloatDType::F32 } else { FloatDType::BF16 };
        let config = DecoderConfig::preset(&self.shape).unwrap_or_else(|| panic!("unknown shape {}", self.shape)).with_max_positions(self.context + self.new);
        let mut init = RandomInit { std: 0.02, dtype };
        if self.ternary {
            let model = build_with::<B, _, _>(&config, &mut init, &device, &mut TernaryMaker::default()).expect("random init");
            self.bench(&model, name)
        } else {
            self.bench(&build::<B, _, _>(&config, &mut init, &device, |_, l| l).expect("random init"), name)
        }
    }
}

impl Args {
    fn bench<B: KilnBackend, L: Projection<B>>(&self, model: &Decoder<B, L>, name: &str) {
        let (config, device) = (&model.config, model.embed_tokens.weight.device());
        let dtype = model.dtype();
        let linears = if self.ternary { "ternary W2A8 linears" } else { "float linears" };
        println!("decode_bench {} on {name}: {} parameters, {:?}, {linears}, context {}, new {}", self.shape, config.num_params(), dtype, self.context, self.new);
        let prompt: Vec<u32> = (0..self.context).map(|i| ((i * 7919 + 13) % config.vocab_size) as u32).collect();
        for round in 0..self.repeats {
            // Prefill alone: the prompt's forward and its last logits, read back.
            let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
            let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, prompt.len()]), &device);
            let start = Instant::now();
            let mut cache = model.new_cache(1, self.context + self.new);
            let hidden = model.hidden(tokens, Some(&mut cache), &[]);
            let _ = model.last_logits(hidden).argmax(1).into_data();
            let prefill = start.elapsed().as_secs_f64();
            drop(cache);
            // Prefill + decode through the generator (greedy, ids read back each step).
            let config = GenerationConfig { max_new_tokens: self.new, ..GenerationConfig::default() };
            let start = Instant::now();
            let mut steps = model.generate(std::slice::from_ref(&prompt), config);
            steps.next();
            let first = Instant::now();
            let decoded = steps.count();
            let decode = first.elapsed().as_secs_f64();
            println!(
                "round {round}: prefill {} tokens {:.2} ms ({:.0} tokens/s); decode {decoded} tokens {:.2} ms ({:.1} tokens/s, {:.0} us/token); generate's first step {:.2} ms",
                prompt.len(),
                prefill * 1e3,
                prompt.len() as f64 / prefill,
                decode * 1e3,
                decoded as f64 / decode,
                decode * 1e6 / decoded.max(1) as f64,
                (first - start).as_secs_f64() * 1e3,
            );
        }
        let kv = config.kv_cache_bytes(1, self.context + self.new, dtype.size());
        println!("KV cache {:.3} GB", kv as f64 / 1e9);
    }
}

fn main() {
    let args = Args::parse();
    if let Err(message) = dispatch(&args.device.clone(), args) {
        eprintln!("decode_bench: {message}");
        std::process::exit(2);
    }
}
