//! kiln's main job: pretrain a small Llama from `kiln-models` with Burn's `Learner` — RMSNorm
//! (+ residual), RoPE, flash attention (forward and backward), SwiGLU and every linear are kiln
//! ops — then generate from it with the KV cache.
//!
//! The data is generated in code: sequences `x_{t+1} = (x_t + step) mod vocab` with a random
//! start and step per sequence, so predicting the next token needs attention to the previous
//! ones, and a trained model continues a prompt by the same rule.
//!
//! `cargo run --release -p kiln-models --example pretrain` picks CUDA (with `--features cuda`),
//! else a wgpu GPU, else the CPU. `--scale 4` (or more) grows the model and data for a GPU.
//! `--optimizer sketched-adamw --sketch-ratio 4` trains with AdamW's moments held in a ternary
//! sketch (`kiln::optim::SketchedAdamW`) and prints the state memory it saves.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderBuilder, batcher::Batcher};
use burn::data::dataset::Dataset;
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData, backend::Backend};
use burn::train::{Learner, SupervisedTraining, metric::LossMetric};
use clap::Parser;
use kiln::KilnBackend;
use kiln::optim::{SketchedAdamW, SketchedAdamWConfig};
use kiln_models::generation::collect_tokens;
use kiln_models::runtime::{OnBackend, dispatch};
use kiln_models::train::{LmBatch, renderer};
use kiln_models::{DecoderConfig, FloatDecoder, GenerationConfig};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Multiplies width, depth, data and batch (1 = a few minutes on a 2-core CPU).
    #[arg(long, default_value_t = 1)]
    scale: usize,
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// auto, cuda, wgpu or cpu.
    #[arg(long, default_value = "auto")]
    device: String,
    #[arg(long, default_value = "target/kiln-pretrain")]
    dir: String,
    /// adamw, or sketched-adamw (AdamW's moments in a ternary sketch, `kiln::optim`).
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// Gradient values per sketched value (sketched-adamw).
    #[arg(long, default_value_t = 4)]
    sketch_ratio: usize,
}

const VOCAB: usize = 32;
const SEQ: usize = 32;

/// Arithmetic sequences mod `VOCAB`, from the item index (no files, no downloads).
struct Sequences {
    len: usize,
    seed: u64,
}

impl Sequences {
    fn start_and_step(&self, index: usize) -> (u64, u64) {
        // SplitMix64 of (seed, index): a fixed, well-mixed start and step per item.
        let mut z = (self.seed ^ index as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let vocab = VOCAB as u64;
        (z % vocab, 1 + (z >> 32) % (vocab - 1))
    }
}

impl Dataset<Vec<i64>> for Sequences {
    fn get(&self, index: usize) -> Option<Vec<i64>> {
        (index < self.len).then(|| {
            let (start, step) = self.start_and_step(index);
            (0..=SEQ as u64).map(|t| ((start + t * step) % VOCAB as u64) as i64).collect()
        })
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[derive(Clone, Default)]
struct NextToken;

impl<B: Backend> Batcher<B, Vec<i64>, LmBatch<B>> for NextToken {
    fn batch(&self, items: Vec<Vec<i64>>, device: &B::Device) -> LmBatch<B> {
        let (b, s) = (items.len(), SEQ);
        let flat: Vec<i64> = items.into_iter().flatten().collect();
        let all = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [b, s + 1]), device);
        LmBatch { inputs: all.clone().narrow(1, 0, s), targets: all.narrow(1, 1, s), mask: None }
    }
}

impl OnBackend for Args {
    type Output = ();

    fn run<B: KilnBackend>(self, device: B::Device, name: &str) {
        println!("kiln: training a small Llama on {name}");
        train::<Autodiff<B>>(device, &self);
    }
}

fn train<B: kiln::KilnAutodiffBackend>(device: B::Device, args: &Args) {
    let scale = args.scale.max(1);
    let width = 64 * scale;
    let config = DecoderConfig::new(VOCAB, width, 2 * width, 2 * scale.min(4), 4, 2, width / 4).with_max_positions(64);
    println!("model: {} parameters, {} layers, {} heads ({} kv heads), head size {}", config.num_params(), config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim);
    let train_loader = DataLoaderBuilder::new(NextToken).batch_size(16 * scale).shuffle(7).set_device(device.clone())
        .build(Sequences { len: 16384 * scale, seed: 1 });
    let valid_loader = DataLoaderBuilder::<B::InnerBackend, _, _>::new(NextToken).batch_size(16 * scale).set_device(device.clone())
        .build(Sequences { len: 256, seed: 2 });
    let model: FloatDecoder<B> = config.init(&device);
    let probe = Sequences { len: 64, seed: 3 };
    let probe_batch: LmBatch<B::InnerBackend> = NextToken.batch((0..64).filter_map(|i| probe.get(i)).collect(), &device);
    let loss_of = |m: &FloatDecoder<B::InnerBackend>| m.lm_loss(probe_batch.clone()).loss.into_scalar().elem::<f64>();
    let before = loss_of(&model.valid());
    let model = match args.optimizer.as_str() {
        "adamw" => fit(args, model, AdamWConfig::new().with_weight_decay(0.0).init::<B, FloatDecoder<B>>(), train_loader, valid_loader),
        "sketched-adamw" => {
            let config = SketchedAdamWConfig::new().with_ratio(args.sketch_ratio).with_weight_decay(0.0);
            report_state_memory(&model, &config.build());
            fit(args, model, config.init::<B, FloatDecoder<B>>(), train_loader, valid_loader)
        }
        other => {
            eprintln!("kiln: unknown --optimizer {other} (adamw or sketched-adamw)");
            std::process::exit(2);
        }
    };
    let after = loss_of(&model);
    println!("validation loss before training {before:.4}, after {after:.4} (uniform guess: {:.4}), optimizer {}", (VOCAB as f64).ln(), args.optimizer);
    show_generation(&model, &probe);
    println!("logs and metrics are in {}", args.dir);
}

/// Train with `optim` under Burn's `Learner`; the trained model, for inference.
fn fit<B, O>(
    args: &Args,
    model: FloatDecoder<B>,
    optim: O,
    train: Arc<dyn DataLoader<B, LmBatch<B>>>,
    valid: Arc<dyn DataLoader<B::InnerBackend, LmBatch<B::InnerBackend>>>,
) -> FloatDecoder<B::InnerBackend>
where
    B: kiln::KilnAutodiffBackend,
    O: Optimizer<FloatDecoder<B>, B> + 'static,
{
    let mut training = SupervisedTraining::new(&args.dir, train, valid).metrics((LossMetric::new(),)).num_epochs(args.epochs);
    if let Some(lines) = renderer(100) {
        training = training.renderer(lines);
    }
    training.launch(Learner::new(model, optim, 3e-3)).model
}

/// The optimizer state's size with sketched moments next to AdamW's (8 bytes a parameter value).
fn report_state_memory<B: kiln::KilnAutodiffBackend>(model: &FloatDecoder<B>, optim: &SketchedAdamW) {
    let sizes = parameter_sizes(model);
    let (sketched, full): (usize, usize) = (sizes.iter().map(|&n| optim.state_bytes(n)).sum(), sizes.iter().map(|n| 8 * n).sum());
    println!(
        "optimizer state: {sketched} bytes with sketched moments against AdamW's {full} ({:.2}x smaller, {} bytes saved)",
        full as f64 / sketched as f64,
        full - sketched
    );
}

/// The number of values of each float parameter of a module.
fn parameter_sizes<B: burn::tensor::backend::Backend, M: Module<B>>(module: &M) -> Vec<usize> {
    struct Sizes(Vec<usize>);
    impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Sizes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.shape().num_elements());
        }
    }
    let mut sizes = Sizes(Vec::new());
    module.visit(&mut sizes);
    sizes.0
}

/// Greedy continuations of a few probe sequences' first 8 tokens, next to the rule's.
fn show_generation<B: KilnBackend>(model: &FloatDecoder<B>, probe: &Sequences) {
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| probe.get(i).unwrap()[..8].iter().map(|&t| t as u32).collect()).collect();
    let config = GenerationConfig { max_new_tokens: 12, ..GenerationConfig::default() };
    let outputs = collect_tokens(model.generate(&prompts, config), prompts.len());
    let mut right = 0;
    for (i, (prompt, out)) in prompts.iter().zip(&outputs).enumerate() {
        let truth: Vec<u32> = probe.get(i).unwrap()[8..20].iter().map(|&t| t as u32).collect();
        right += out.iter().zip(&truth).filter(|(a, b)| a == b).count();
        println!("prompt {prompt:?} → generated {out:?} (rule: {truth:?})");
    }
    println!("generation: {right}/{} tokens follow the rule", 12 * prompts.len());
}

fn main() {
    let args = Args::parse();
    if let Err(message) = dispatch(&args.device.clone(), args) {
        eprintln!("kiln: {message}");
        std::process::exit(2);
    }
}
