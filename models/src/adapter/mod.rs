//! LoRA adapters on a decoder's linears, chosen by name as PEFT's `target_modules` chooses them,
//! and PEFT's adapter files ([`peft`]).
//!
//! ```no_run
//! # use kiln_models::adapter::{Targets, add_lora};
//! # fn demo<B: kiln::KilnBackend>(decoder: kiln_models::FloatDecoder<B>) {
//! let config = kiln::nn::LoraConfig::new().with_rank(16).with_alpha(32.0);
//! let model = add_lora(decoder, &config, &Targets::AllLinear);
//! # }
//! ```

pub mod peft;

use burn::module::Module;
use burn::tensor::FloatDType;
use burn::tensor::backend::Backend;
use kiln::nn::{LinearLayer, LoraConfig, LoraLinear};

pub use peft::{load_adapter, save_adapter};

use crate::model::Decoder;

/// A decoder whose projections are LoRA layers over `L` (the untargeted ones without adapter).
pub type LoraDecoder<B, L> = Decoder<B, LoraLinear<B, L>>;

/// Which linears get an adapter, by HF module path (`model.layers.3.self_attn.q_proj`).
#[derive(Debug, Clone)]
pub enum Targets {
    /// Every attention and MLP linear (PEFT's `"all-linear"`: the output head is left out).
    AllLinear,
    /// Layers whose path is one of these names or ends with `.name` (PEFT's list form:
    /// `["q_proj", "v_proj"]`).
    Modules(Vec<String>),
    /// Layers whose whole path matches this regular expression (PEFT's string form).
    Pattern(regex::Regex),
}

impl Targets {
    /// The list form from names.
    pub fn modules<S: Into<String>>(names: impl IntoIterator<Item = S>) -> Self {
        Self::Modules(names.into_iter().map(Into::into).collect())
    }

    /// The string form: `"all-linear"`, or a regular expression the whole path must match.
    pub fn pattern(pattern: &str) -> Result<Self, regex::Error> {
        if pattern == "all-linear" {
            return Ok(Self::AllLinear);
        }
        Ok(Self::Pattern(regex::Regex::new(&format!("^(?:{pattern})$"))?))
    }

    pub fn matches(&self, path: &str) -> bool {
        match self {
            Self::AllLinear => true,
            Self::Modules(names) => names.iter().any(|n| path == n || path.strip_suffix(n.as_str()).is_some_and(|p| p.ends_with('.'))),
            Self::Pattern(re) => re.is_match(path),
        }
    }
}

/// The decoder with every parameter frozen and a fresh adapter (`config`, in the model's dtype)
/// on each targeted linear: the model a LoRA fine-tune trains (only the adapters take gradients).
pub fn add_lora<B: Backend, L: LinearLayer<B>>(decoder: Decoder<B, L>, config: &LoraConfig, targets: &Targets) -> LoraDecoder<B, L> {
    let device = decoder.embed_tokens.weight.device();
    let dtype = FloatDType::from(decoder.dtype());
    decoder.no_grad().map_linears(|name, base| {
        let layer = LoraLinear::frozen(base);
        if targets.matches(name) {
            let adapter = config.init_adapter(layer.base.d_input(), layer.base.d_output(), &device).cast(dtype);
            layer.with_adapter(adapter)
        } else {
            layer
        }
    })
}

/// The base layers back, each float one with its adapter's update merged in
/// (PEFT's `merge_and_unload`).
pub fn merge_and_unload<B: kiln::ops::lora::LoraBackend>(decoder: LoraDecoder<B, kiln::nn::Linear<B>>) -> crate::FloatDecoder<B> {
    decoder.map_linears(|_, layer| layer.merge_and_unload())
}
