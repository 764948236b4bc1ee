//! Prefill and decode speed of a randomly initialized model of a real checkpoint's shape
//! (Qwen2.5-0.5B, Llama-3.2-1B, BitNet b1.58 2B, or a tiny one for a CPU smoke run): prefill
//! tokens/s at a context, then greedy decode tokens/s at batch 1 over that context, each step's
//! token read back as in real generation; `--ternary` packs the attention and MLP linears to
//! 2-bit ternary weights (W2A8 products). Each round decodes op by op and then with the steps
//! replayed from a CUDA graph (where the backend has them), and fails unless both give the same
//! tokens. The GPU check runs it next to `benches/peers/decode.py` (transformers).
//!
//! `cargo run --release -p kiln-models --features cuda --example decode_bench -- --shape qwen2.5-0.5b`

use std::time::Instant;

use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use clap::Parser;
use kiln::KilnBackend;
use kiln_models::loader::RandomInit;
use kiln_models::model::build::build;
use kiln_models::runtime::{OnBackend, dispatch};
use kiln_models::{Decoder, DecoderConfig, GenerationConfig, Nf4Maker, Projection, TernaryMaker, build_with};

#[path = "common/pool.rs"]
mod pool;

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
    /// NF4 attention and MLP linears (QLoRA's base: block 64, double quantization).
    #[arg(long)]
    nf4: bool,
    /// After the rounds, one more generation whose device memory is reported: CubeCL's pool after
    /// the prefill (unused pages released) and after the decode (CUDA only).
    #[arg(long)]
    memory: bool,
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
        } else if self.nf4 {
            let model = build_with::<B, _, _>(&config, &mut init, &device, &mut Nf4Maker::default()).expect("random init");
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
        let linears = if self.ternary {
            "ternary W2A8 linears"
        } else if self.nf4 {
            "NF4 linears"
        } else {
            "float linears"
        };
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
            println!("round {round}: prefill {} tokens {:.2} ms ({:.0} tokens/s)", prompt.len(), prefill * 1e3, prompt.len() as f64 / prefill);
            // Prefill + decode through the generator (greedy, ids read back each step), op by op
            // and replayed from a CUDA graph where the backend has them; the tokens must agree.
            let plain = self.decode(model, &prompt, false);
            let graph = self.decode(model, &prompt, true);
            println!("round {round}: replayed tokens equal the plain ones: {}", plain == graph);
            assert_eq!(plain, graph, "decode_bench: the tokens of the replayed steps differ from the plain ones");
        }
        let kv = config.kv_cache_bytes(1, self.context + self.new, dtype.size());
        println!("KV cache {:.3} GB", kv as f64 / 1e9);
        if self.memory {
            self.memory(model, &prompt, kv);
        }
    }
}

impl Args {
    /// Generates `self.new` tokens after `prompt`, prints the decode speed (all steps, and the
    /// steady state from the fifth step on) and returns the tokens.
    fn decode<B: KilnBackend, L: Projection<B>>(&self, model: &Decoder<B, L>, prompt: &[u32], cuda_graph: bool) -> Vec<u32> {
        let config = GenerationConfig { max_new_tokens: self.new, cuda_graph, ..GenerationConfig::default() };
        let start = Instant::now();
        let mut steps = model.generate(&[prompt.to_vec()], config);
        let mut times = Vec::with_capacity(self.new);
        let mut tokens = Vec::with_capacity(self.new);
        for step in steps.by_ref() {
            times.push(Instant::now());
            tokens.extend(step[0]);
        }
        let rate = |from: usize| {
            let n = times.len().saturating_sub(from + 1);
            let secs = times.last().zip(times.get(from)).map_or(0.0, |(end, begin)| (*end - *begin).as_secs_f64());
            (n, n as f64 / secs.max(1e-9), secs * 1e6 / n.max(1) as f64)
        };
        let ((all, all_rate, _), (steady, steady_rate, steady_us)) = (rate(0), rate(4));
        println!(
            "  {:?}: first step (prefill) {:.2} ms; decode {all} tokens {all_rate:.1} tokens/s; steady ({steady} tokens from the 5th) {steady_rate:.1} tokens/s, {steady_us:.0} us/token",
            steps.step_path(),
            times.first().map_or(0.0, |t| (*t - start).as_secs_f64() * 1e3),
        );
        tokens
    }
}

impl Args {
    /// The device memory of a generation: CubeCL's pool after the prefill (its unused pages
    /// released) and after the decode, against the weights and the KV cache. The pool only grows
    /// while decoding, so its reserve after the decode bounds the decode's peak.
    fn memory<B: KilnBackend, L: Projection<B>>(&self, model: &Decoder<B, L>, prompt: &[u32], kv: usize) {
        let device = model.embed_tokens.weight.device();
        let weights = model.config.num_params() * model.dtype().size();
        let mut steps = model.generate(&[prompt.to_vec()], GenerationConfig { max_new_tokens: self.new, ..GenerationConfig::default() });
        steps.next();
        B::memory_cleanup(&device);
        let after_prefill = pool::pool_usage(&device);
        let decoded = steps.by_ref().count();
        let after_decode = pool::pool_usage(&device);
        println!(
            "memory ({:?}): weights {:.3} GB + KV cache {:.3} GB; pool after the prefill: {}; after {decoded} decode steps: {}",
            steps.step_path(),
            weights as f64 / 1e9,
            kv as f64 / 1e9,
            pool::describe(after_prefill),
            pool::describe(after_decode)
        );
    }
}

fn main() {
    let args = Args::parse();
    if let Err(message) = dispatch(&args.device.clone(), args) {
        eprintln!("decode_bench: {message}");
        std::process::exit(2);
    }
}
