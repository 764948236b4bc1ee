//! `kiln`: run HF Llama/Qwen/Mistral checkpoints on kiln's kernels.
//!
//! - `kiln generate --model DIR --prompt TEXT [--chat] [--nf4 | --ternary]` streams the
//!   continuation and ends with prefill and decode tokens/s. A checkpoint saved with bitsandbytes
//!   4-bit weights runs in 4 bits, a BitNet one (HF's packed `BitNetForCausalLM`, llama.cpp's
//!   `bitnet` GGUF) on packed ternary weights; `--nf4` / `--ternary` quantize a float one while
//!   loading.
//! - `kiln info DIR` prints the config, the parameter count and the memory it needs.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::FloatDType;
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kiln::KilnBackend;
use kiln_models::config::from_hf_json;
use kiln_models::generation::{StepPath, StopStrings};
use kiln_models::gguf::GgufFile;
use kiln_models::loader::{SafetensorsSource, config_from_gguf};
use kiln_models::model::build::check_all_used;
use kiln_models::model::{Decoder, Projection};
use kiln_models::runtime::{OnBackend, dispatch};
use kiln_models::tokenizer::TextStream;
use kiln_models::{
    GenerationConfig, LoadOptions, MakeLinear, MapFloat, Message, Nf4Maker, Nf4Options, SamplingConfig, TernaryMaker, Tokenizer, build_with, load,
    load_bitnet, load_nf4,
};

#[derive(Parser)]
#[command(name = "kiln", about = "Run HF Llama, Qwen and Mistral checkpoints on kiln's fused kernels")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it as it comes.
    Generate(GenerateArgs),
    /// Print a checkpoint's config, parameter count and memory.
    Info {
        /// Model directory (config.json + safetensors) or a .gguf file.
        model: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

impl From<Dtype> for FloatDType {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::F32 => FloatDType::F32,
            Dtype::F16 => FloatDType::F16,
            Dtype::Bf16 => FloatDType::BF16,
        }
    }
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// Model directory (config.json, safetensors single or sharded, tokenizer.json) or a .gguf file.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long)]
    min_p: Option<f64>,
    #[arg(long)]
    repetition_penalty: Option<f64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// auto, cuda, wgpu or cpu.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Dtype the weights are loaded in (default: bf16 on CUDA, f32 elsewhere).
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// Quantize the attention and MLP linears to NF4 while loading (QLoRA's format: block 64,
    /// double quantization). Checkpoints stored in 4 bits by bitsandbytes load in 4 bits anyway.
    #[arg(long, conflicts_with = "ternary")]
    nf4: bool,
    /// Quantize the attention and MLP linears to BitNet b1.58 ternary weights (one scale a
    /// tensor; W2A8 products) while loading. BitNet checkpoints load packed anyway.
    #[arg(long)]
    ternary: bool,
    /// Decode op by op through Burn, without replaying the step from a CUDA graph (greedy
    /// decoding on CUDA replays by default).
    #[arg(long)]
    no_cuda_graph: bool,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info { model } => info(&model),
        Command::Generate(args) => {
            let device = args.device.clone();
            dispatch(&device, args).and_then(|r| r)
        }
    };
    if let Err(message) = result {
        eprintln!("kiln: {message}");
        std::process::exit(1);
    }
}

fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gguf")
}

fn info(path: &Path) -> Result<(), String> {
    let (family, config, stored) = if is_gguf(path) {
        let file = GgufFile::open(path).map_err(|e| e.to_string())?;
        let (family, config) = config_from_gguf(&file).map_err(|e| e.to_string())?;
        let bytes: usize = file.tensors().iter().map(|t| t.n_bytes).sum();
        (family, config, bytes as u64)
    } else {
        let (family, config) = from_hf_json(path).map_err(|e| e.to_string())?;
        let source = SafetensorsSource::open(path, FloatDType::F32).map_err(|e| e.to_string())?;
        (family, config, source.total_bytes())
    };
    let params = config.num_params();
    println!("family: {family:?}");
    println!("{config}");
    println!("parameters: {params} ({:.3} B)", params as f64 / 1e9);
    println!("checkpoint: {:.3} GB of tensors", stored as f64 / 1e9);
    for (name, bytes) in [("f32", 4), ("bf16/f16", 2)] {
        println!(
            "memory in {name}: weights {:.3} GB, KV cache {:.3} GB per 1k tokens of one sequence",
            (params * bytes) as f64 / 1e9,
            config.kv_cache_bytes(1, 1024, bytes) as f64 / 1e9
        );
    }
    Ok(())
}

impl OnBackend for GenerateArgs {
    type Output = Result<(), String>;

    fn run<B: KilnBackend>(self, device: B::Device, name: &str) -> Result<(), String> {
        eprintln!("kiln: running on {name}");
        let is_cuda = name.starts_with("CUDA");
        let dtype: FloatDType = self.dtype.map(Into::into).unwrap_or(if is_cuda { FloatDType::BF16 } else { FloatDType::F32 });
        let gguf = is_gguf(&self.model).then(|| GgufFile::open(&self.model)).transpose().map_err(|e| e.to_string())?;
        let tokenizer = match &gguf {
            Some(file) => Tokenizer::from_gguf(file),
            None => Tokenizer::from_dir(&self.model),
        }
        .map_err(|e| e.to_string())?;
        let prompt = if self.chat {
            let mut messages: Vec<Message> = self.system.iter().map(|s| Message::new("system", s.clone())).collect();
            messages.push(Message::new("user", self.prompt.clone()));
            tokenizer.encode_chat(&messages, true)
        } else {
            tokenizer.encode(&self.prompt, true)
        }
        .map_err(|e| e.to_string())?;
        let options = LoadOptions { dtype, max_positions: Some(prompt.len() + self.max_new_tokens) };
        let err = |e: kiln_models::LoadError| e.to_string();
        if let Some(file) = &gguf {
            let bitnet = file.str("general.architecture").map_err(err)? == "bitnet";
            if bitnet && self.nf4 {
                return Err("a bitnet GGUF holds ternary weights: --nf4 does not apply".into());
            }
            return match (self.nf4, self.ternary || bitnet) {
                (true, _) => self.stream(&load_nf4::<B>(&self.model, &options, Nf4Options::default(), &device).map_err(err)?.1, &tokenizer, &prompt),
                (_, true) => self.stream(&load_bitnet::<B>(&self.model, &options, &device).map_err(err)?.1, &tokenizer, &prompt),
                _ => self.stream(&load::<B>(&self.model, &options, &device).map_err(err)?.1, &tokenizer, &prompt),
            };
        }
        let source = SafetensorsSource::open(&self.model, dtype).map_err(err)?;
        let stores_4bit = source.names().any(kiln::ops::nf4::bnb::is_state);
        let stores_ternary = source.names().any(|n| n.ends_with(".weight_scale"));
        if self.ternary || stores_ternary {
            eprintln!("kiln: ternary linears ({})", if stores_ternary { "as stored, packed" } else { "BitNet b1.58, quantized while loading" });
            let mut maker = TernaryMaker::from_config(&self.model).map_err(err)?;
            let model = load_with_progress::<B, _>(&self.model, source, &options, &device, &mut maker)?;
            self.stream(&model, &tokenizer, &prompt)
        } else if self.nf4 || stores_4bit {
            eprintln!("kiln: 4-bit linears ({})", if stores_4bit { "as stored by bitsandbytes" } else { "NF4, quantized while loading" });
            let model = load_with_progress::<B, _>(&self.model, source, &options, &device, &mut Nf4Maker::default())?;
            self.stream(&model, &tokenizer, &prompt)
        } else {
            let model = load_with_progress::<B, _>(&self.model, source, &options, &device, &mut MapFloat(|_: &str, l| l))?;
            self.stream(&model, &tokenizer, &prompt)
        }
    }
}

/// A HF checkpoint built layer by layer by `maker`, with a progress bar over the bytes read.
fn load_with_progress<B: KilnBackend, M: MakeLinear<B>>(
    dir: &Path,
    source: SafetensorsSource,
    options: &LoadOptions,
    device: &B::Device,
    maker: &mut M,
) -> Result<Decoder<B, M::Linear>, String> {
    let mut config = from_hf_json(dir).map_err(|e| e.to_string())?.1;
    check_all_used(&source, &config, dir, |n| maker.consumes(n)).map_err(|e| e.to_string())?;
    if let Some(positions) = options.max_positions {
        config = config.with_max_positions(positions);
    }
    let bar = ProgressBar::new(source.total_bytes());
    bar.set_style(ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} {elapsed}").map_err(|e| e.to_string())?);
    let tick = bar.clone();
    let mut source = source.with_progress(move |bytes| tick.inc(bytes));
    let model = build_with(&config, &mut source, device, maker).map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    Ok(model)
}

impl GenerateArgs {
    /// Generate from `prompt` with `model`, streaming the text, then print the speeds.
    fn stream<B: KilnBackend, L: Projection<B>>(&self, model: &Decoder<B, L>, tokenizer: &Tokenizer, prompt: &[u32]) -> Result<(), String> {
        let config = &model.config;
        let mut stop_tokens = config.eos_token_ids.clone();
        stop_tokens.extend(["<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>"].iter().filter_map(|t| tokenizer.token_id(t)));
        let generation = GenerationConfig {
            max_new_tokens: self.max_new_tokens,
            sampling: SamplingConfig {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repetition_penalty: self.repetition_penalty,
                seed: self.seed,
            },
            stop_tokens,
            pad_token: 0,
            cuda_graph: !self.no_cuda_graph,
        };
        generation.sampling.validate()?;
        let start = Instant::now();
        let mut first = None;
        let mut count = 0usize;
        let mut stream = TextStream::default();
        let mut stops = StopStrings::new(self.stop.clone());
        let mut out = std::io::stdout();
        let mut steps = model.generate(&[prompt.to_vec()], generation);
        for step in steps.by_ref() {
            first.get_or_insert_with(Instant::now);
            let Some(id) = step[0] else { break };
            count += 1;
            let (text, stopped) = stops.push(&stream.push(tokenizer, id).map_err(|e| e.to_string())?);
            print!("{text}");
            out.flush().ok();
            if stopped {
                break;
            }
        }
        print!("{}", stops.finish());
        println!();
        let end = Instant::now();
        let prefill = first.map_or(end - start, |f| f - start).as_secs_f64();
        let decode = first.map_or(0.0, |f| (end - f).as_secs_f64());
        eprintln!(
            "prefill: {} tokens in {:.1} ms ({:.1} tokens/s); decode: {} tokens in {:.1} ms ({:.1} tokens/s)",
            prompt.len(),
            prefill * 1e3,
            prompt.len() as f64 / prefill,
            count.saturating_sub(1),
            decode * 1e3,
            count.saturating_sub(1) as f64 / decode.max(1e-9)
        );
        if let StepPath::Graph { kernels, parts, .. } = steps.step_path() {
            eprintln!("decode steps replayed from CUDA graphs ({parts} parts, {kernels} kernels)");
        }
        Ok(())
    }
}
