//! LoRA adapters (LoRA, rsLoRA; QLoRA when the base is an [`crate::nn::Nf4Linear`]) around any
//! [`LinearLayer`], with PEFT's parameter layouts and initialization.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::config::Config;
use burn::module::{Initializer, Module, Param};
use burn::tensor::{Tensor, backend::Backend};

use crate::nn::{Linear, LinearLayer};
use crate::ops::lora::{DropoutMask, LoraBackend, LoraSpec, lora};

/// Configuration of a LoRA adapter; PEFT's `LoraConfig` fields and defaults.
#[derive(Config, Debug)]
pub struct LoraConfig {
    /// The rank `r`.
    #[config(default = 8)]
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r` (`alpha / √r` with `rslora`).
    #[config(default = 8.0)]
    pub alpha: f64,
    /// `lora_dropout`: the drop probability on the adapter's input while training.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// `use_rslora`: rank-stabilized scaling `alpha / √r`.
    #[config(default = false)]
    pub rslora: bool,
}

impl LoraConfig {
    /// `s` of `y = base(x) + s · x · Aᵀ · Bᵀ`.
    pub fn scale(&self) -> f64 {
        let r = self.rank as f64;
        if self.rslora { self.alpha / r.sqrt() } else { self.alpha / r }
    }

    /// A fresh adapter for a `[d_input → d_output]` layer, initialized as PEFT does: `A`
    /// Kaiming-uniform (bound `1/√d_input`, PyTorch's `kaiming_uniform_(a=√5)`), `B` zero, so the
    /// adapted layer starts equal to its base.
    ///
    /// # Panics
    /// If the rank is 0 or the dropout is outside `[0, 1)`.
    pub fn init_adapter<B: Backend>(&self, d_input: usize, d_output: usize, device: &B::Device) -> LoraAdapter<B> {
        assert!(self.rank > 0, "kiln::nn::LoraConfig: rank must be at least 1");
        assert!((0.0..1.0).contains(&self.dropout), "kiln::nn::LoraConfig: dropout {} must be in [0, 1)", self.dropout);
        let kaiming = Initializer::KaimingUniform { gain: 1.0 / 3f64.sqrt(), fan_out_only: false };
        LoraAdapter {
            lora_a: kaiming.init_with([self.rank, d_input], Some(d_input), Some(self.rank), device),
            lora_b: Initializer::Zeros.init([d_output, self.rank], device),
            config: self.clone(),
        }
    }

    /// `base`, frozen, with a fresh adapter.
    pub fn init<B: Backend, L: LinearLayer<B>>(&self, base: L, device: &B::Device) -> LoraLinear<B, L> {
        let adapter = self.init_adapter(base.d_input(), base.d_output(), device);
        LoraLinear::frozen(base).with_adapter(adapter)
    }
}

/// The trainable part of a LoRA layer: PEFT's `lora_A.weight` `[r, in]` and `lora_B.weight`
/// `[out, r]`, and the configuration that gives its scale and dropout.
#[derive(Module, Debug)]
pub struct LoraAdapter<B: Backend> {
    pub lora_a: Param<Tensor<B, 2>>,
    pub lora_b: Param<Tensor<B, 2>>,
    #[module(skip)]
    pub config: LoraConfig,
}

impl<B: Backend> LoraAdapter<B> {
    /// An adapter from given `A` `[r, in]` and `B` `[out, r]` (e.g. read from a PEFT file), both
    /// trainable; `config.rank` is taken from `A`.
    ///
    /// # Panics
    /// If the shapes do not fit each other.
    pub fn new(lora_a: Tensor<B, 2>, lora_b: Tensor<B, 2>, config: &LoraConfig) -> Self {
        let (a, b) = (lora_a.shape(), lora_b.shape());
        assert!(b[1] == a[0], "kiln::nn::LoraAdapter: lora_A {:?} and lora_B {:?} must be [r, in] and [out, r]", a.as_slice(), b.as_slice());
        let config = LoraConfig { rank: a[0], ..config.clone() };
        Self { lora_a: Param::from_tensor(lora_a), lora_b: Param::from_tensor(lora_b), config }
    }

    pub fn rank(&self) -> usize {
        self.lora_a.shape()[0]
    }

    /// `s`: `alpha / r`, or `alpha / √r` for rsLoRA.
    pub fn scale(&self) -> f64 {
        self.config.scale()
    }

    /// `s · Aᵀ · Bᵀ`: the update in Burn's `[d_input, d_output]` weight layout.
    pub fn delta(&self) -> Tensor<B, 2>
    where
        B: LoraBackend,
    {
        crate::ops::matmul(self.lora_a.val().transpose(), self.lora_b.val().transpose()) * self.scale()
    }
}

/// A frozen base layer with an optional LoRA adapter: `y = base(x) + s · dropout(x) · Aᵀ · Bᵀ`
/// through [`crate::ops::lora`] (the update added in the second product's epilogue). Layers a
/// model leaves unadapted carry no adapter, so every projection of a model has one type.
///
/// The base's parameters take no gradient (no optimizer state either); `A` and `B` train. The
/// dropout is active only where the backend tracks gradients, each forward with a fresh mask
/// ([`seed_lora_dropout`] makes the sequence reproducible).
#[derive(Module, Debug)]
pub struct LoraLinear<B: Backend, L> {
    pub base: L,
    pub adapter: Option<LoraAdapter<B>>,
    /// Whether the adapter's update has been added into the base weight ([`LoraLinear::merge`]).
    #[module(skip)]
    pub merged: bool,
}

impl<B: Backend, L: LinearLayer<B>> LoraLinear<B, L> {
    /// `base` with its parameters frozen and no adapter.
    pub fn frozen(base: L) -> Self {
        Self { base: base.no_grad(), adapter: None, merged: false }
    }

    /// The layer with `adapter` (replacing any other).
    ///
    /// # Panics
    /// If the adapter's shapes do not fit the base.
    pub fn with_adapter(self, adapter: LoraAdapter<B>) -> Self {
        let (a, b) = (adapter.lora_a.shape(), adapter.lora_b.shape());
        let (d_in, d_out) = (self.base.d_input(), self.base.d_output());
        assert!(
            a[1] == d_in && b[0] == d_out && b[1] == a[0],
            "kiln::nn::LoraLinear: lora_A {:?} must be [r, {d_in}] and lora_B {:?} [{d_out}, r]",
            a.as_slice(),
            b.as_slice()
        );
        assert!(!self.merged, "kiln::nn::LoraLinear: unmerge before replacing a merged adapter");
        Self { adapter: Some(adapter), ..self }
    }
}

/// The next dropout seed of every LoRA layer in the process (a Weyl sequence; the mask hashes it).
static DROPOUT_SEED: AtomicU64 = AtomicU64::new(0x5eed_1e55_0f10_4a11);

/// Restart the sequence of LoRA dropout masks from `seed`: a run that seeds it (and Burn's own
/// RNG) and repeats its forwards repeats its masks.
pub fn seed_lora_dropout(seed: u64) {
    DROPOUT_SEED.store(seed, Ordering::Relaxed);
}

fn next_dropout_seed() -> u64 {
    DROPOUT_SEED.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
}

impl<B: LoraBackend, L: LinearLayer<B>> LinearLayer<B> for LoraLinear<B, L> {
    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let Some(adapter) = self.adapter.as_ref().filter(|_| !self.merged) else {
            return self.base.forward(x);
        };
        let p = adapter.config.dropout;
        let dropout = (p > 0.0 && B::ad_enabled(&x.device())).then(|| DropoutMask::new(p, next_dropout_seed()));
        let spec = LoraSpec { scale: adapter.scale() as f32, dropout };
        let base = self.base.forward(x.clone());
        lora(x, base, adapter.lora_a.val(), adapter.lora_b.val(), spec)
    }

    fn d_input(&self) -> usize {
        self.base.d_input()
    }

    fn d_output(&self) -> usize {
        self.base.d_output()
    }
}

impl<B: LoraBackend> LoraLinear<B, Linear<B>> {
    /// Add the adapter's update into the float base weight (the forward then skips the adapter).
    /// No-op without an adapter or when merged already.
    pub fn merge(&mut self) {
        self.shift_base(false);
    }

    /// Take the update back out of the base weight.
    pub fn unmerge(&mut self) {
        self.shift_base(true);
    }

    /// The base with the update merged in, the adapter dropped (PEFT's `merge_and_unload`).
    pub fn merge_and_unload(mut self) -> Linear<B> {
        self.merge();
        self.base
    }

    fn shift_base(&mut self, unmerge: bool) {
        let Some(adapter) = &self.adapter else { return };
        if self.merged != unmerge {
            return;
        }
        let delta = adapter.delta().detach();
        let delta = if unmerge { delta.neg() } else { delta };
        let weight = self.base.weight.clone().map(|w| {
            let dtype = w.dtype();
            (w + delta.cast(dtype)).detach().set_require_grad(false)
        });
        self.base.weight = weight;
        self.merged = !unmerge;
    }
}
