//! AdamW with its moments held in a ternary sketch ([`crate::ops::sketch`]): each parameter's
//! gradient `g` (n values) is compressed at ratio `r` to `⌈n / r⌉` values, both moments are
//! updated there, and the step decompresses them:
//!
//! - `m ← β₁m + (1 − β₁)·P·g` (signed buckets), `v ← β₂v + (1 − β₂)·|P|·g²` (bucket sums of squares);
//! - `Δⱼ = m̂ⱼ / (√v̂ⱼ + ε)` with `m̂ = Pᵀm / (1 − β₁ᵗ)` and `v̂ = |P|ᵀv / (r · (1 − β₂ᵗ))` (the
//!   bucket's mean square), then decoupled weight decay as Burn's AdamW: `w ← w·(1 − lr·λ) − lr·Δ`,
//!   in f32, rounded once to the parameter's dtype.
//!
//! A step is [`sketch::adamw_step`]: on CubeCL backends two kernels (both moments from one gather
//! of the gradient, then the update), not a chain of sketch passes and elementwise ops.
//!
//! The state costs `2⌈n / r⌉` f32 a parameter instead of `2n`. The price is the sketch's
//! interference: `m̂ⱼ` carries its bucket mates' momenta with random signs (zero mean, variance
//! `(r − 1)` times theirs; `format` states the bound), which acts as structured noise on the
//! update. Parameters under `min_elements` values keep exact moments (ratio 1).

use burn::config::Config;
use burn::module::AutodiffModule;
use burn::optim::{LearningRate, SimpleOptimizer, adaptor::OptimizerAdaptor};
use burn::record::Record;
use burn::tensor::{DType, Tensor, backend::{AutodiffBackend, Backend}};

use crate::ops::sketch::{self, AdamWScalars, Sketch, SketchBackend};

/// Configuration of [`SketchedAdamW`].
#[derive(Config, Debug)]
pub struct SketchedAdamWConfig {
    /// Gradient values per compressed value.
    #[config(default = 4)]
    pub ratio: usize,
    /// Seed of the projection (the same for every parameter and step: the moments accumulate in
    /// one fixed space).
    #[config(default = 0)]
    pub seed: u64,
    /// Parameters with fewer values keep exact moments.
    #[config(default = 4096)]
    pub min_elements: usize,
    #[config(default = 0.9)]
    pub beta_1: f32,
    #[config(default = 0.999)]
    pub beta_2: f32,
    #[config(default = 1e-5)]
    pub epsilon: f32,
    #[config(default = 1e-4)]
    pub weight_decay: f32,
}

/// AdamW with sketched moments (module docs).
#[derive(Clone, Debug)]
pub struct SketchedAdamW {
    config: SketchedAdamWConfig,
}

/// The compressed moments of one parameter and its step count.
#[derive(Record, Clone)]
pub struct SketchedAdamWState<B: Backend, const D: usize> {
    /// First moment, `⌈n / r⌉` f32.
    pub moment_1: Tensor<B, 1>,
    /// Second moment (bucket sums of squares), `⌈n / r⌉` f32.
    pub moment_2: Tensor<B, 1>,
    pub time: usize,
}

impl SketchedAdamWConfig {
    /// The optimizer alone (for [`SimpleOptimizer`] use).
    ///
    /// # Panics
    /// If the ratio is 0.
    pub fn build(&self) -> SketchedAdamW {
        assert!(self.ratio >= 1, "kiln::SketchedAdamW: the compression ratio must be at least 1, got 0");
        SketchedAdamW { config: self.clone() }
    }

    /// The optimizer for a module, as Burn's `AdamWConfig::init`.
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(&self) -> OptimizerAdaptor<SketchedAdamW, M, B>
    where
        B::InnerBackend: SketchBackend,
    {
        OptimizerAdaptor::from(self.build())
    }
}

impl SketchedAdamW {
    /// The sketch of a parameter of `n` values.
    pub fn sketch(&self, n: usize) -> Sketch {
        let ratio = if n < self.config.min_elements { 1 } else { self.config.ratio };
        Sketch::new(n, ratio, self.config.seed).unwrap_or_else(|e| panic!("kiln::SketchedAdamW: {e}"))
    }

    /// Bytes of optimizer state for a parameter of `n` values (AdamW's: `8n`).
    pub fn state_bytes(&self, n: usize) -> usize {
        8 * self.sketch(n).compressed()
    }
}

impl<B: SketchBackend> SimpleOptimizer<B> for SketchedAdamW {
    type State<const D: usize> = SketchedAdamWState<B, D>;

    fn step<const D: usize>(&self, lr: LearningRate, tensor: Tensor<B, D>, grad: Tensor<B, D>, state: Option<Self::State<D>>) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let c = &self.config;
        let shape = tensor.shape();
        let sketch = self.sketch(shape.num_elements());
        let (moments, time) = match state {
            Some(s) => ([s.moment_1, s.moment_2], s.time + 1),
            None => ([(); 2].map(|_| Tensor::zeros([sketch.compressed()], (&tensor.device(), DType::F32))), 1),
        };
        let scalars = AdamWScalars::new(c.beta_1, c.beta_2, c.epsilon, c.weight_decay, lr, time, sketch.ratio);
        let (w, [moment_1, moment_2]) = sketch::adamw_step(tensor.reshape([sketch.n]), grad.reshape([sketch.n]), moments, &sketch, scalars);
        (w.reshape(shape), Some(SketchedAdamWState { moment_1, moment_2, time }))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        state.moment_1 = state.moment_1.to_device(device);
        state.moment_2 = state.moment_2.to_device(device);
        state
    }
}
