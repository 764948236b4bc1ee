//! LoRA adapters (LoRA, rsLoRA, DoRA; QLoRA when the base is an [`crate::nn::Nf4Linear`]) around
//! any [`LinearLayer`], with PEFT's parameter layouts and initialization.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::config::Config;
use burn::module::{Initializer, Module, Param};
use burn::tensor::{DType, FloatDType, Tensor, backend::Backend};

use crate::nn::{Linear, LinearLayer};
use crate::ops::dora::{self, dora, dora_norm};
use crate::ops::{prim, wrap};
use crate::ops::lora::{DropoutMask, LoraBackend, LoraSpec, lora, lora_dropout, lora_linear, lora_linear_4bit};

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
    /// `use_dora`: DoRA, the update's direction rescaled per output by a trained magnitude.
    #[config(default = false)]
    pub dora: bool,
}

impl LoraConfig {
    /// `s` of `y = base(x) + s · x · Aᵀ · Bᵀ`.
    pub fn scale(&self) -> f64 {
        let r = self.rank as f64;
        if self.rslora { self.alpha / r.sqrt() } else { self.alpha / r }
    }

    /// A fresh adapter for a `[d_input → d_output]` layer, initialized as PEFT does: `A`
    /// Kaiming-uniform (bound `1/√d_input`, PyTorch's `kaiming_uniform_(a=√5)`), `B` zero, so the
    /// adapted layer starts equal to its base. A DoRA adapter's magnitude comes from the base's
    /// weight, so it is set when the adapter is attached ([`LoraLinear::with_adapter`]).
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
            magnitude: None,
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
/// `[out, r]`, DoRA's magnitude, and the configuration that gives its scale and dropout.
#[derive(Module, Debug)]
pub struct LoraAdapter<B: Backend> {
    pub lora_a: Param<Tensor<B, 2>>,
    pub lora_b: Param<Tensor<B, 2>>,
    /// DoRA's magnitude `m` `[out]` (PEFT's `lora_magnitude_vector`).
    pub magnitude: Option<Param<Tensor<B, 1>>>,
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
        Self { lora_a: Param::from_tensor(lora_a), lora_b: Param::from_tensor(lora_b), magnitude: None, config }
    }

    /// The adapter as DoRA with the given magnitude `[out]` (e.g. PEFT's `lora_magnitude_vector`).
    ///
    /// # Panics
    /// If the magnitude is not `[out]`.
    pub fn with_magnitude(self, magnitude: Tensor<B, 1>) -> Self {
        let (m, b) = (magnitude.shape(), self.lora_b.shape());
        assert!(m[0] == b[0], "kiln::nn::LoraAdapter: magnitude {:?} must be [out] for lora_B {:?}", m.as_slice(), b.as_slice());
        Self { magnitude: Some(Param::from_tensor(magnitude.detach())), config: LoraConfig { dora: true, ..self.config }, ..self }
    }

    /// The adapter's parameters in `dtype` (the model's: the LoRA product takes `x`, the base
    /// output and the adapter in one dtype), still trainable where they were.
    pub fn cast(self, dtype: FloatDType) -> Self {
        fn to<B: Backend, const D: usize>(p: Param<Tensor<B, D>>, dtype: FloatDType) -> Param<Tensor<B, D>> {
            p.map(|t| {
                let tracked = t.is_require_grad();
                // Detached after the cast: a tracked parameter must be a leaf.
                let t = t.cast(dtype).detach();
                if tracked { t.require_grad() } else { t }
            })
        }
        Self { lora_a: to(self.lora_a, dtype), lora_b: to(self.lora_b, dtype), magnitude: self.magnitude.map(|m| to(m, dtype)), ..self }
    }

    pub fn rank(&self) -> usize {
        self.lora_a.shape()[0]
    }

    /// `s`: `alpha / r`, or `alpha / √r` for rsLoRA.
    pub fn scale(&self) -> f64 {
        self.config.scale()
    }

    /// `s · Aᵀ · Bᵀ`: the update in Burn's `[d_input, d_output]` weight layout, computed and
    /// returned in f32 (merging a bf16 model rounds once, at the end).
    pub fn delta(&self) -> Tensor<B, 2>
    where
        B: LoraBackend,
    {
        let [a, b] = [self.lora_a.val(), self.lora_b.val()].map(|t| t.cast(FloatDType::F32));
        crate::ops::matmul(a.transpose(), b.transpose()) * self.scale()
    }
}

/// A frozen base layer with an optional LoRA adapter: `y = base(x) + s · dropout(x) · Aᵀ · Bᵀ`
/// through [`crate::ops::lora`] (over a float base the whole layer as one operation,
/// [`lora_linear`]; over a quantized one the update added in a second product's epilogue), and
/// for a DoRA adapter that output rescaled per output by `m / ‖W + ΔW‖` ([`crate::ops::dora`]).
/// Layers a model leaves unadapted carry no adapter, so every projection of a model has one type.
///
/// The base's parameters take no gradient (no optimizer state either); `A`, `B` (and `m`) train.
/// The dropout is active only where the backend tracks gradients, each forward with a fresh mask
/// ([`seed_lora_dropout`] makes the sequence reproducible).
#[derive(Module, Debug)]
pub struct LoraLinear<B: Backend, L> {
    pub base: L,
    pub adapter: Option<LoraAdapter<B>>,
    /// `‖W_o‖²` of the frozen base weight per output (f32), the constant part of DoRA's norm;
    /// set with a DoRA adapter.
    pub base_norms_sq: Option<Tensor<B, 1>>,
    /// DoRA's `m / ‖W + ΔW‖` at the time of [`LoraLinear::merge`], which unmerge divides out.
    pub merged_scale: Option<Tensor<B, 1>>,
    /// Whether the adapter's update has been added into the base weight ([`LoraLinear::merge`]).
    #[module(skip)]
    pub merged: bool,
}

impl<B: Backend, L: LinearLayer<B>> LoraLinear<B, L> {
    /// `base` with its parameters frozen and no adapter.
    pub fn frozen(base: L) -> Self {
        Self { base: base.no_grad(), adapter: None, base_norms_sq: None, merged_scale: None, merged: false }
    }

    /// The layer with `adapter` (replacing any other). A DoRA adapter without a magnitude gets
    /// PEFT's initial one, `‖W + ΔW‖` per output.
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
        if !adapter.config.dora {
            return Self { adapter: Some(adapter), base_norms_sq: None, ..self };
        }
        let norms_sq = self.base.dense_weight(DType::F32).square().sum_dim(0).squeeze_dim::<1>(0).detach();
        let adapter = match adapter.magnitude {
            Some(_) => adapter,
            None => {
                // Through the reference: this serves any backend, and it runs once per adapter.
                let (a, a_w) = Self::dora_factors(&self.base, &adapter);
                let b = adapter.lora_b.val().detach();
                let norm: Tensor<B, 1> = wrap(dora::reference::norm::<B>(prim(norms_sq.clone()), prim(a_w), prim(a), prim(b), adapter.scale()));
                let dtype = adapter.lora_a.val().dtype();
                adapter.with_magnitude(norm.cast(FloatDType::from(dtype)))
            }
        };
        Self { adapter: Some(adapter), base_norms_sq: Some(norms_sq), ..self }
    }

    /// `A` (detached) and `A · Wᵀ`, the base without its bias applied to `A`'s rows: with `‖W‖²`
    /// and `B`, the inputs of DoRA's factored weight norm.
    fn dora_factors(base: &L, adapter: &LoraAdapter<B>) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let a = adapter.lora_a.val().detach();
        let a_w = base.forward(a.clone());
        let a_w = match base.bias() {
            Some(bias) => a_w - bias.cast(FloatDType::from(a.dtype())).unsqueeze(),
            None => a_w,
        };
        (a, a_w)
    }
}

impl<B: LoraBackend, L: LinearLayer<B>> LoraLinear<B, L> {
    /// DoRA's forward: `y = c · (u − b) + b` on the LoRA output `u`, `c = m / ‖W + ΔW‖`. With
    /// dropout, PEFT's form: the base on the full input plus `(c − 1) · W · x̃ + c · ΔW · x̃` on the
    /// dropped-out `x̃`, which takes a second base product.
    fn dora_forward<const D: usize>(&self, x: Tensor<B, D>, adapter: &LoraAdapter<B>, magnitude: Tensor<B, 1>, dropout: Option<DropoutMask>) -> Tensor<B, D> {
        let norms_sq = self.base_norms_sq.clone().expect("a DoRA adapter is attached with the base's norms");
        let (a, a_w) = Self::dora_factors(&self.base, adapter);
        let norm = dora_norm(norms_sq, a_w, a, adapter.lora_b.val(), adapter.scale());
        let (a, b, bias) = (adapter.lora_a.val(), adapter.lora_b.val(), self.base.bias());
        let spec = LoraSpec { scale: adapter.scale() as f32, dropout: None };
        match dropout {
            None => dora(self.with_update(x, a, b, spec), magnitude, norm, bias),
            Some(mask) => {
                let dropped = lora_dropout(x.clone(), mask);
                let base_dropped = self.base.forward(dropped.clone());
                let rescaled = dora(lora(dropped, base_dropped.clone(), a, b, spec), magnitude, norm, bias);
                self.base.forward(x) - base_dropped + rescaled
            }
        }
    }

    /// The forward with `dropout` on the adapter's input (`None`: none), where
    /// [`LinearLayer::forward`] draws a fresh mask each call while training.
    pub fn forward_with_dropout<const D: usize>(&self, x: Tensor<B, D>, dropout: Option<DropoutMask>) -> Tensor<B, D> {
        let Some(adapter) = self.adapter.as_ref().filter(|_| !self.merged) else {
            return self.base.forward(x);
        };
        if let Some(m) = &adapter.magnitude {
            return self.dora_forward(x, adapter, m.val(), dropout);
        }
        let spec = LoraSpec { scale: adapter.scale() as f32, dropout };
        self.with_update(x, adapter.lora_a.val(), adapter.lora_b.val(), spec)
    }

    /// `base(x) + s · dropout(x) · Aᵀ · Bᵀ`: one op where the base shows its weight (float or
    /// 4-bit), so that a backend may run the base's product and the update together; else the
    /// base's forward and the update added to it.
    fn with_update<const D: usize>(&self, x: Tensor<B, D>, a: Tensor<B, 2>, b: Tensor<B, 2>, spec: LoraSpec) -> Tensor<B, D> {
        if let Some(weight) = self.base.float_weight() {
            return lora_linear(x, weight, self.base.bias(), a, b, spec);
        }
        if let Some(weight) = self.base.packed_weight() {
            // The 4-bit layer adds its bias in the output's dtype.
            let bias = self.base.bias().map(|bias| bias.cast(FloatDType::from(x.dtype())));
            return lora_linear_4bit(x, &weight, bias, a, b, spec);
        }
        let base = self.base.forward(x.clone());
        lora(x, base, a, b, spec)
    }

    /// The weight the forward applies, `[d_input, d_output]` in f32: `W + ΔW`, for DoRA
    /// rescaled per output column.
    fn adapted_weight(&self, adapter: &LoraAdapter<B>) -> Tensor<B, 2> {
        let sum = self.base.dense_weight(DType::F32) + adapter.delta();
        match &adapter.magnitude {
            Some(m) => sum.clone() * dora_scale(&sum, m.val()).unsqueeze(),
            None => sum,
        }
    }
}

/// `m / ‖W_o‖` per output column of a `[d_input, d_output]` weight, f32.
fn dora_scale<B: Backend>(weight: &Tensor<B, 2>, magnitude: Tensor<B, 1>) -> Tensor<B, 1> {
    magnitude.cast(FloatDType::F32) / weight.clone().square().sum_dim(0).sqrt().squeeze_dim::<1>(0)
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
        self.forward_with_dropout(x, dropout)
    }

    fn d_input(&self) -> usize {
        self.base.d_input()
    }

    fn d_output(&self) -> usize {
        self.base.d_output()
    }

    fn bias(&self) -> Option<Tensor<B, 1>> {
        self.base.bias()
    }

    fn dense_weight(&self, dtype: DType) -> Tensor<B, 2> {
        match self.adapter.as_ref().filter(|_| !self.merged) {
            Some(adapter) => self.adapted_weight(adapter).cast(FloatDType::from(dtype)),
            None => self.base.dense_weight(dtype),
        }
    }
}

impl<B: LoraBackend> LoraLinear<B, Linear<B>> {
    /// Put the adapter's update into the float base weight (the forward then skips the adapter):
    /// `W + ΔW`, for DoRA `m · (W + ΔW) / ‖W + ΔW‖`. No-op without an adapter or when merged
    /// already.
    pub fn merge(&mut self) {
        let Some(adapter) = self.adapter.as_ref().filter(|_| !self.merged) else { return };
        let sum = self.base.dense_weight(DType::F32) + adapter.delta();
        let merged = match &adapter.magnitude {
            Some(m) => {
                let scale = dora_scale(&sum, m.val()).detach();
                self.merged_scale = Some(scale.clone());
                sum * scale.unsqueeze()
            }
            None => sum,
        };
        self.set_base_weight(merged);
        self.merged = true;
    }

    /// Take the update back out of the base weight.
    pub fn unmerge(&mut self) {
        let Some(adapter) = self.adapter.as_ref().filter(|_| self.merged) else { return };
        let weight = self.base.dense_weight(DType::F32);
        let weight = match self.merged_scale.take() {
            Some(scale) => weight / scale.unsqueeze(),
            None => weight,
        };
        let unmerged = weight - adapter.delta();
        self.set_base_weight(unmerged);
        self.merged = false;
    }

    /// The base with the update merged in, the adapter dropped (PEFT's `merge_and_unload`).
    pub fn merge_and_unload(mut self) -> Linear<B> {
        self.merge();
        self.base
    }

    /// Replace the base weight by `weight` (f32) in the base's dtype, frozen.
    fn set_base_weight(&mut self, weight: Tensor<B, 2>) {
        let weight = weight.detach();
        self.base.weight = self.base.weight.clone().map(|w| weight.cast(FloatDType::from(w.dtype())).set_require_grad(false));
    }
}
