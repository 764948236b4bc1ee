//! The one configuration every supported family maps to, and its reading from HF `config.json`.

mod hf;

use burn::config::Config;
use kiln::ops::{rope::RopeScaling, swiglu::GluActivation};

pub use hf::{Family, from_hf_json, from_hf_value};
pub(crate) use hf::{ACTIVATIONS, activation_named};

/// A pre-norm decoder-only transformer with RMSNorm, RoPE, GQA attention and a gated MLP: Llama
/// 2/3/3.1/3.2, Qwen2/2.5, Qwen3, Mistral and BitNet b1.58 are this with different flags.
#[derive(Config, Debug, PartialEq)]
pub struct DecoderConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    #[config(default = 1e-6)]
    pub rms_norm_eps: f64,
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    #[config(default = "RopeScaling::None")]
    pub rope_scaling: RopeScaling,
    /// Per-pair divisors of the RoPE frequencies, applied after `rope_scaling` (GGUF stores Llama
    /// 3.1's scaling this way, as the tensor `rope_freqs.weight`).
    #[config(default = "None")]
    pub rope_freq_factors: Option<Vec<f64>>,
    /// Positions the RoPE tables cover (the longest prompt + generation).
    #[config(default = 4096)]
    pub max_positions: usize,
    /// Bias on the q/k/v projections (Qwen2; Llama's `attention_bias`).
    #[config(default = false)]
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`; not Qwen2).
    #[config(default = false)]
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama's `mlp_bias`).
    #[config(default = false)]
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    #[config(default = false)]
    pub qk_norm: bool,
    /// The MLP's gate activation (HF's `hidden_act`: `silu`, BitNet's `relu2`).
    #[config(default = "GluActivation::Silu")]
    pub activation: GluActivation,
    /// RMSNorms on the attention output and on the gated MLP product, before the projections that
    /// take them (BitNet b1.58's `attn_sub_norm`, `ffn_sub_norm`).
    #[config(default = false)]
    pub sub_norms: bool,
    /// Sliding attention window (Mistral; Qwen2 with `use_sliding_window`).
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// Which layers use `sliding_window` (`None`: all of them).
    #[config(default = "None")]
    pub sliding_layers: Option<Vec<bool>>,
    /// The output head reuses the embedding matrix (Llama 3.2, small Qwens).
    #[config(default = false)]
    pub tie_embeddings: bool,
    #[config(default = "None")]
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    #[config(default = "Vec::new()")]
    pub eos_token_ids: Vec<u32>,
}

impl DecoderConfig {
    /// The shape of a public checkpoint, for benches that run random weights at a real size:
    /// `qwen2.5-0.5b`, `llama3.2-1b` (without its llama3 RoPE scaling, which costs nothing),
    /// `bitnet-2b` (BitNet b1.58 2B-4T), or `tiny` for CPU smoke runs.
    pub fn preset(name: &str) -> Option<Self> {
        Some(match name {
            "qwen2.5-0.5b" => Self::new(151_936, 896, 4864, 24, 14, 2, 64)
                .with_rope_theta(1e6)
                .with_qkv_bias(true)
                .with_tie_embeddings(true)
                .with_rms_norm_eps(1e-6),
            "llama3.2-1b" => Self::new(128_256, 2048, 8192, 16, 32, 8, 64)
                .with_rope_theta(500_000.0)
                .with_tie_embeddings(true)
                .with_rms_norm_eps(1e-5),
            "bitnet-2b" => Self::new(128_256, 2560, 6912, 30, 20, 5, 128)
                .with_rope_theta(500_000.0)
                .with_tie_embeddings(true)
                .with_rms_norm_eps(1e-5)
                .with_activation(GluActivation::Relu2)
                .with_sub_norms(true),
            "tiny" => Self::new(512, 64, 128, 2, 4, 2, 16),
            _ => return None,
        })
    }

    /// The attention window of layer `index`, if it slides.
    pub fn window(&self, index: usize) -> Option<usize> {
        let slides = self.sliding_layers.as_ref().is_none_or(|l| l.get(index).copied().unwrap_or(false));
        self.sliding_window.filter(|_| slides)
    }

    /// The RoPE inverse frequencies of one head's rotated pairs.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let mut inv_freq = self.rope_scaling.inv_freq(self.head_dim, self.rope_theta);
        if let Some(factors) = &self.rope_freq_factors {
            inv_freq.iter_mut().zip(factors).for_each(|(f, d)| *f /= d);
        }
        inv_freq
    }

    /// Parameters of the model (tied embeddings counted once).
    pub fn num_params(&self) -> usize {
        let (d, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (q, kv) = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim);
        let bias = |on: bool, n: usize| if on { n } else { 0 };
        let attention = d * (q + 2 * kv) + q * d + bias(self.qkv_bias, q + 2 * kv) + bias(self.o_bias, d)
            + if self.qk_norm { 2 * self.head_dim } else { 0 };
        let mlp = 3 * d * f + bias(self.mlp_bias, 2 * f + d);
        let sub_norms = if self.sub_norms { q + f } else { 0 };
        let layer = attention + mlp + sub_norms + 2 * d;
        v * d + self.num_layers * layer + d + if self.tie_embeddings { 0 } else { v * d }
    }

    /// Bytes of a KV cache for `batch` sequences of `positions`, at `bytes_per_element`.
    pub fn kv_cache_bytes(&self, batch: usize, positions: usize, bytes_per_element: usize) -> usize {
        2 * self.num_layers * batch * self.num_kv_heads * positions * self.head_dim * bytes_per_element
    }

    /// Checks the shapes fit together; the message names the fields.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_positions", self.max_positions),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!("num_heads {} is not a multiple of num_kv_heads {}", self.num_heads, self.num_kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if let Some(factors) = &self.rope_freq_factors
            && (factors.len() != self.head_dim / 2 || factors.iter().any(|f| !(f.is_finite() && *f > 0.0)))
        {
            return Err(format!("rope_freq_factors needs head_dim/2 = {} positive factors, got {}", self.head_dim / 2, factors.len()));
        }
        if self.sliding_window == Some(0) {
            return Err("sliding_window must be at least 1".into());
        }
        if let Some(layers) = &self.sliding_layers
            && layers.len() != self.num_layers
        {
            return Err(format!("sliding_layers has {} entries for {} layers", layers.len(), self.num_layers));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0 && self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!("rms_norm_eps {} and rope_theta {} must be finite, theta positive", self.rms_norm_eps, self.rope_theta));
        }
        Ok(())
    }
}
