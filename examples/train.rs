//! kiln's main job: train a small pre-norm transformer language model whose norms, QK-norm +
//! RoPE and SwiGLU MLPs run on kiln's fused kernels, with Burn's `Learner`, on a synthetic task
//! generated in code: sequences `x_{t+1} = (x_t + step) mod vocab` with a random start and step
//! per sequence, so predicting the next token needs attention to the previous ones.
//!
//! `cargo run --release --features cuda --example train` picks CUDA, else a wgpu GPU, else the
//! CPU (NdArray), and says which. `--scale 4` (or more) grows the model and data for a GPU.

use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::config::Config;
use burn::data::{dataloader::{DataLoaderBuilder, batcher::Batcher}, dataset::Dataset};
use burn::module::{AutodiffModule, Module};
use burn::tensor::ElementConversion;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, loss::CrossEntropyLossConfig};
use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor, TensorData, backend::Backend, module::attention, ops::AttentionModuleOptions};
use burn::train::{ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep, metric::LossMetric};
use clap::Parser;
use kiln::nn::{GatedMlp, GatedMlpConfig, RmsNorm, RmsNormConfig};
use kiln::ops::{RopeTable, rms_norm_rope, rope::RopeScaling};
use kiln::{KilnAutodiffBackend, KilnBackend};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Multiplies width, depth of data and batch (1 = a few minutes on a 2-core CPU).
    #[arg(long, default_value_t = 1)]
    scale: usize,
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// auto, cuda, wgpu or cpu.
    #[arg(long, default_value = "auto")]
    device: String,
    #[arg(long, default_value = "target/kiln-train")]
    dir: String,
}

#[derive(Config, Debug)]
struct TinyLmConfig {
    vocab: usize,
    d_model: usize,
    n_heads: usize,
    n_layers: usize,
    d_ff: usize,
    max_seq: usize,
}

#[derive(Module, Debug)]
struct Block<B: Backend> {
    attn_norm: RmsNorm<B>,
    q_norm: RmsNorm<B>,
    k_norm: RmsNorm<B>,
    wq: Linear<B>,
    wk: Linear<B>,
    wv: Linear<B>,
    wo: Linear<B>,
    mlp_norm: RmsNorm<B>,
    mlp: GatedMlp<B>,
    n_heads: usize,
}

#[derive(Module, Debug)]
struct TinyLm<B: Backend> {
    embed: Embedding<B>,
    blocks: Vec<Block<B>>,
    norm: RmsNorm<B>,
    head: Linear<B>,
    rope: RopeTable<B>,
}

impl TinyLmConfig {
    fn init<B: Backend>(&self, device: &B::Device) -> TinyLm<B> {
        let d = self.d_model;
        let hd = d / self.n_heads;
        let lin = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        let blocks = (0..self.n_layers)
            .map(|_| Block {
                attn_norm: RmsNormConfig::new(d).init(device),
                q_norm: RmsNormConfig::new(hd).init(device),
                k_norm: RmsNormConfig::new(hd).init(device),
                wq: lin(d, d),
                wk: lin(d, d),
                wv: lin(d, d),
                wo: lin(d, d),
                mlp_norm: RmsNormConfig::new(d).init(device),
                mlp: GatedMlpConfig::new(d, self.d_ff).init(device),
                n_heads: self.n_heads,
            })
            .collect();
        TinyLm {
            embed: EmbeddingConfig::new(self.vocab, d).init(device),
            blocks,
            norm: RmsNormConfig::new(d).init(device),
            head: lin(d, self.vocab),
            rope: RopeTable::new(hd, self.max_seq, 10_000.0, RopeScaling::None, device),
        }
    }
}

impl<B: KilnBackend> Block<B> {
    /// Causal self-attention with fused QK-norm + RoPE.
    fn attend(&self, x: Tensor<B, 3>, rope: &RopeTable<B>) -> Tensor<B, 3> {
        let [b, s, d] = x.dims();
        let (h, hd) = (self.n_heads, d / self.n_heads);
        let heads = |t: Tensor<B, 3>| t.reshape([b, s, h, hd]);
        let (q, k) = rms_norm_rope(
            heads(self.wq.forward(x.clone())),
            heads(self.wk.forward(x.clone())),
            self.q_norm.weight.val(),
            self.k_norm.weight.val(),
            rope,
            0,
            1e-6,
        );
        let v = heads(self.wv.forward(x)).swap_dims(1, 2);
        let options = AttentionModuleOptions { is_causal: true, ..Default::default() };
        let out = attention(q.swap_dims(1, 2), k.swap_dims(1, 2), v, None, None, options);
        self.wo.forward(out.swap_dims(1, 2).reshape([b, s, d]))
    }
}

impl<B: KilnBackend> TinyLm<B> {
    /// Logits `[batch, seq, vocab]`. The residual stream is updated inside the fused
    /// `rms_norm_residual` of each norm that follows a sub-block.
    fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let mut residual = self.embed.forward(tokens);
        let mut pending: Option<Tensor<B, 3>> = None;
        for block in &self.blocks {
            let (normed, r) = match pending.take() {
                Some(delta) => block.attn_norm.forward_residual(delta, residual),
                None => (block.attn_norm.forward(residual.clone()), residual),
            };
            let (normed, r) = block.mlp_norm.forward_residual(block.attend(normed, &self.rope), r);
            pending = Some(block.mlp.forward(normed));
            residual = r;
        }
        let out = match pending {
            Some(delta) => self.norm.forward_residual(delta, residual).0,
            None => self.norm.forward(residual),
        };
        self.head.forward(out)
    }

    fn loss(&self, batch: LmBatch<B>) -> ClassificationOutput<B> {
        let logits = self.forward(batch.inputs);
        let [b, s, v] = logits.dims();
        let logits = logits.reshape([b * s, v]);
        let targets = batch.targets.reshape([b * s]);
        let loss = CrossEntropyLossConfig::new().init(&logits.device()).forward(logits.clone(), targets.clone());
        ClassificationOutput::new(loss, logits, targets)
    }
}

impl<B: KilnAutodiffBackend> TrainStep for TinyLm<B> {
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.loss(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: KilnBackend> InferenceStep for TinyLm<B> {
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> ClassificationOutput<B> {
        self.loss(batch)
    }
}

/// Arithmetic sequences mod `vocab`, generated from the item index (no files, no downloads).
struct Sequences {
    len: usize,
    seq: usize,
    vocab: usize,
    seed: u64,
}

impl Dataset<Vec<i64>> for Sequences {
    fn get(&self, index: usize) -> Option<Vec<i64>> {
        (index < self.len).then(|| {
            // SplitMix64 of (seed, index): a fixed, well-mixed start and step per item.
            let mut z = (self.seed ^ index as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let vocab = self.vocab as u64;
            let (start, step) = (z % vocab, 1 + (z >> 32) % (vocab - 1));
            (0..=self.seq as u64).map(|t| ((start + t * step) % vocab) as i64).collect()
        })
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[derive(Clone, Debug)]
struct LmBatch<B: Backend> {
    inputs: Tensor<B, 2, Int>,
    targets: Tensor<B, 2, Int>,
}

#[derive(Clone, Default)]
struct LmBatcher;

impl<B: Backend> Batcher<B, Vec<i64>, LmBatch<B>> for LmBatcher {
    fn batch(&self, items: Vec<Vec<i64>>, device: &B::Device) -> LmBatch<B> {
        let (b, s) = (items.len(), items[0].len() - 1);
        let flat: Vec<i64> = items.into_iter().flatten().collect();
        let all = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [b, s + 1]), device);
        LmBatch { inputs: all.clone().narrow(1, 0, s), targets: all.narrow(1, 1, s) }
    }
}

fn train<B: KilnAutodiffBackend>(device: B::Device, args: &Args) {
    let scale = args.scale.max(1);
    let config = TinyLmConfig::new(32, 64 * scale, 4, 2 * scale.min(4), 128 * scale, 64);
    let seq = 32;
    let data = |len, seed| Sequences { len, seq, vocab: config.vocab, seed };
    let train_loader = DataLoaderBuilder::new(LmBatcher).batch_size(16 * scale).shuffle(7).set_device(device.clone())
        .build(data(2048 * scale, 1));
    let valid_loader = DataLoaderBuilder::<B::InnerBackend, _, _>::new(LmBatcher).batch_size(16 * scale).set_device(device.clone())
        .build(data(256, 2));
    let model = config.init::<B>(&device);
    let probe_items = (0..64).filter_map(|i| data(256, 3).get(i)).collect();
    let probe: LmBatch<B::InnerBackend> = LmBatcher.batch(probe_items, &device);
    let loss_of = |m: &TinyLm<B::InnerBackend>| m.loss(probe.clone()).loss.into_scalar().elem::<f64>();
    let before = loss_of(&model.valid());
    let optim = AdamWConfig::new().with_weight_decay(0.0).init::<B, TinyLm<B>>();
    let learner = Learner::new(model, optim, 3e-3);
    let result = SupervisedTraining::new(&args.dir, train_loader as Arc<_>, valid_loader as Arc<_>)
        .metrics((LossMetric::new(),))
        .num_epochs(args.epochs)
        .summary()
        .launch(learner);
    let after = loss_of(&result.model);
    println!("validation loss before training {before:.4}, after {after:.4} (uniform guess: {:.4})", (config.vocab as f64).ln());
    println!("training finished; logs and metrics are in {}", args.dir);
}

/// Runs `f` and reports whether it completed without panicking (used to probe devices).
fn works<T>(f: impl FnOnce() -> T) -> bool {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_ok();
    std::panic::set_hook(hook);
    ok
}

fn main() {
    let args = Args::parse();
    let want = args.device.as_str();
    #[cfg(feature = "cuda")]
    {
        use burn::backend::{Cuda, cuda::CudaDevice};
        let device = CudaDevice::default();
        if matches!(want, "auto" | "cuda") && works(|| Tensor::<Cuda, 1>::ones([1], &device).into_data()) {
            println!("kiln: training on CUDA device 0 (kiln CUDA kernels)");
            return train::<Autodiff<Cuda>>(device, &args);
        }
    }
    if want == "cuda" {
        eprintln!("kiln: --device cuda asked for, but no CUDA device works (or built without --features cuda)");
        std::process::exit(2);
    }
    #[cfg(feature = "wgpu")]
    {
        use burn::backend::{Wgpu, wgpu::WgpuDevice};
        // `auto` takes a real GPU only; `--device wgpu` also accepts a software adapter (lavapipe).
        let candidates = match want {
            "auto" => vec![WgpuDevice::DiscreteGpu(0), WgpuDevice::IntegratedGpu(0)],
            "wgpu" => vec![WgpuDevice::DefaultDevice],
            _ => vec![],
        };
        for device in candidates {
            if works(|| Tensor::<Wgpu, 1>::ones([1], &device).into_data()) {
                println!("kiln: training on wgpu {device:?} (kiln CubeCL kernels)");
                return train::<Autodiff<Wgpu>>(device, &args);
            }
        }
    }
    println!("kiln: no CUDA or wgpu GPU found; training on the CPU with NdArray (kiln reference ops)");
    train::<Autodiff<NdArray>>(Default::default(), &args);
}
