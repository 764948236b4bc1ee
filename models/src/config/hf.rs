//! HF `config.json` → [`DecoderConfig`]. Reads both spellings of RoPE settings: the
//! `rope_theta` + `rope_scaling` of checkpoints on the Hub and transformers 5's `rope_parameters`.

use std::path::Path;

use serde_json::{Map, Value};

use super::DecoderConfig;
use crate::error::{LoadError, Result};
use kiln::ops::{rope::RopeScaling, swiglu::GluActivation};

/// The model families `config.json`'s `model_type` may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
    /// BitNet b1.58 (`BitNetForCausalLM`): Llama with squared-ReLU gating and sub-norms; its
    /// packed ternary linears load with `load_bitnet`.
    BitNet,
}

impl Family {
    fn from_model_type(model_type: &str) -> Option<Self> {
        Some(match model_type {
            "llama" => Self::Llama,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            "mistral" => Self::Mistral,
            "bitnet" => Self::BitNet,
            _ => return None,
        })
    }
}

/// Reads `config.json` (a file, or a model directory holding one).
pub fn from_hf_json(path: &Path) -> Result<(Family, DecoderConfig)> {
    let path = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    let text = std::fs::read_to_string(&path).map_err(|e| LoadError::io(&path, e))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| LoadError::malformed(&path, format!("not JSON: {e}")))?;
    from_hf_value(&value, &path)
}

/// The activations kiln's MLP computes, by HF's names.
pub(crate) const ACTIVATIONS: &str = "silu, relu2, gelu_pytorch_tanh";

/// The MLP gate activation HF's `hidden_act` (and GGUF's `{arch}.hidden_activation`) names.
pub(crate) fn activation_named(name: &str) -> Option<GluActivation> {
    match name {
        "silu" => Some(GluActivation::Silu),
        "relu2" => Some(GluActivation::Relu2),
        "gelu_pytorch_tanh" => Some(GluActivation::GeluTanh),
        _ => None,
    }
}

/// [`from_hf_json`] on parsed JSON; `path` names the file in errors.
pub fn from_hf_value(value: &Value, path: &Path) -> Result<(Family, DecoderConfig)> {
    let fields = Fields { map: value.as_object().ok_or_else(|| LoadError::malformed(path, "the top level is not an object"))?, path };
    let model_type = fields.string("model_type")?;
    let family = Family::from_model_type(&model_type).ok_or_else(|| {
        fields.error("model_type", format!("`{model_type}` is not supported (llama, qwen2, qwen3, mistral, bitnet)"))
    })?;
    let act = fields.opt_string("hidden_act")?.unwrap_or_else(|| "silu".into());
    let activation = activation_named(&act).ok_or_else(|| fields.error("hidden_act", format!("`{act}` is not supported ({ACTIVATIONS})")))?;
    let hidden_size = fields.usize("hidden_size")?;
    let num_heads = fields.usize("num_attention_heads")?;
    let num_layers = fields.usize("num_hidden_layers")?;
    let head_dim = match fields.opt_usize("head_dim")? {
        Some(d) => d,
        None if num_heads > 0 && hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => return Err(fields.error("head_dim", format!("missing, and hidden_size {hidden_size} does not split into {num_heads} heads"))),
    };
    let (rope_theta, rope_scaling) = fields.rope()?;
    let attention_bias = fields.opt_bool("attention_bias")?.unwrap_or(false);
    let (sliding_window, sliding_layers) = fields.sliding(family, num_layers)?;
    let config = DecoderConfig {
        vocab_size: fields.usize("vocab_size")?,
        hidden_size,
        intermediate_size: fields.usize("intermediate_size")?,
        num_layers,
        num_heads,
        num_kv_heads: fields.opt_usize("num_key_value_heads")?.unwrap_or(num_heads),
        head_dim,
        rms_norm_eps: fields.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        rope_freq_factors: None,
        max_positions: fields.opt_usize("max_position_embeddings")?.unwrap_or(4096),
        // Qwen2 always biases q/k/v and never o; Llama/Qwen3's `attention_bias` covers all four.
        qkv_bias: family == Family::Qwen2 || attention_bias,
        o_bias: family != Family::Qwen2 && attention_bias,
        mlp_bias: fields.opt_bool("mlp_bias")?.unwrap_or(false),
        qk_norm: family == Family::Qwen3,
        activation,
        sub_norms: family == Family::BitNet,
        sliding_window,
        sliding_layers,
        tie_embeddings: fields.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        bos_token_id: fields.opt_u32("bos_token_id")?,
        eos_token_ids: fields.token_ids("eos_token_id")?,
    };
    config.validate().map_err(|m| LoadError::malformed(path, m))?;
    Ok((family, config))
}

/// Typed access to a JSON object's fields with errors naming the file and field.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn error(&self, field: impl Into<String>, message: impl Into<String>) -> LoadError {
        LoadError::field(self.path, field, message)
    }

    /// The field's value, `None` when absent or `null`.
    fn get(&self, name: &str) -> Option<&Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, name: &str) -> Result<Option<usize>> {
        self.get(name)
            .map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok()).ok_or_else(|| self.error(name, format!("expected a non-negative integer, got {v}"))))
            .transpose()
    }

    fn usize(&self, name: &str) -> Result<usize> {
        self.opt_usize(name)?.ok_or_else(|| self.error(name, "missing"))
    }

    fn opt_u32(&self, name: &str) -> Result<Option<u32>> {
        self.opt_usize(name)?
            .map(|n| u32::try_from(n).map_err(|_| self.error(name, format!("{n} is not a token id"))))
            .transpose()
    }

    fn opt_f64(&self, name: &str) -> Result<Option<f64>> {
        self.get(name).map(|v| v.as_f64().ok_or_else(|| self.error(name, format!("expected a number, got {v}")))).transpose()
    }

    fn opt_bool(&self, name: &str) -> Result<Option<bool>> {
        self.get(name).map(|v| v.as_bool().ok_or_else(|| self.error(name, format!("expected true or false, got {v}")))).transpose()
    }

    fn opt_string(&self, name: &str) -> Result<Option<String>> {
        self.get(name)
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| self.error(name, format!("expected a string, got {v}"))))
            .transpose()
    }

    fn string(&self, name: &str) -> Result<String> {
        self.opt_string(name)?.ok_or_else(|| self.error(name, "missing"))
    }

    /// A token id or a list of them (`eos_token_id` is either).
    fn token_ids(&self, name: &str) -> Result<Vec<u32>> {
        let bad = |v: &Value| self.error(name, format!("expected a token id or a list of them, got {v}"));
        let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(v));
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(id).collect(),
            Some(v) => Ok(vec![id(v)?]),
        }
    }

    /// `(theta, scaling)` from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`.
    fn rope(&self) -> Result<(f64, RopeScaling)> {
        let (params, params_name) = match (self.get("rope_parameters"), self.get("rope_scaling")) {
            (Some(p), _) => (Some(p), "rope_parameters"),
            (None, s) => (s, "rope_scaling"),
        };
        let params = params
            .map(|p| p.as_object().ok_or_else(|| self.error(params_name, format!("expected an object, got {p}"))))
            .transpose()?;
        let nested = params.map(|map| Fields { map, path: self.path });
        let theta = match nested.as_ref().map(|n| n.opt_f64("rope_theta")).transpose()?.flatten() {
            Some(t) => t,
            None => self.opt_f64("rope_theta")?.unwrap_or(10000.0),
        };
        let Some(p) = nested else { return Ok((theta, RopeScaling::None)) };
        let kind = match p.opt_string("rope_type")? {
            Some(k) => k,
            None => p.opt_string("type")?.unwrap_or_else(|| "default".into()),
        };
        let field = |name: &str| format!("{params_name}.{name}");
        let number = |name: &str| p.opt_f64(name)?.ok_or_else(|| self.error(field(name), "missing"));
        let scaling = match kind.as_str() {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: number("factor")? },
            "llama3" => RopeScaling::Llama3 {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_positions: p.opt_usize("original_max_position_embeddings")?.ok_or_else(|| self.error(field("original_max_position_embeddings"), "missing"))?,
            },
            other => return Err(self.error(field("rope_type"), format!("`{other}` is not supported (default, linear, llama3)"))),
        };
        Ok((theta, scaling))
    }

    /// The sliding window and, when only some layers slide, which ones. Mistral's window covers
    /// every layer; Qwen2's only with `use_sliding_window`, from `max_window_layers` on, unless
    /// transformers 5's `layer_types` says per layer.
    fn sliding(&self, family: Family, num_layers: usize) -> Result<(Option<usize>, Option<Vec<bool>>)> {
        let window = self.opt_usize("sliding_window")?;
        let used = match family {
            Family::Mistral => true,
            Family::Llama | Family::BitNet => false,
            Family::Qwen2 | Family::Qwen3 => self.opt_bool("use_sliding_window")?.unwrap_or(false),
        };
        let Some(window) = window.filter(|_| used) else { return Ok((None, None)) };
        if let Some(types) = self.get("layer_types") {
            let items = types.as_array().filter(|a| a.len() == num_layers).ok_or_else(|| {
                self.error("layer_types", format!("expected a list of {num_layers} layer types"))
            })?;
            let layers = items
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(self.error("layer_types", format!("unknown layer type {t}"))),
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok((Some(window), Some(layers)));
        }
        if family == Family::Mistral {
            return Ok((Some(window), None));
        }
        let from = self.opt_usize("max_window_layers")?.unwrap_or(0);
        Ok((Some(window), Some((0..num_layers).map(|i| i >= from).collect())))
    }
}
