//! BitNet b1.58 decoders: any family's config with ternary linears. [`to_bitnet`] patches a float
//! decoder for quantization-aware training ([`BitLinear`]: latent weights, straight-through
//! gradients); [`pack_ternary`] turns the trained decoder into packed 2-bit [`TernaryLinear`]s
//! whose products run the W2A8 kernels. The embedding, norms and head stay float, as in BitNet.
//! [`load_bitnet`] reads HF's `BitNetForCausalLM` checkpoints (2-bit packed `weight` +
//! `weight_scale` per linear) and llama.cpp's `bitnet` GGUFs into the same packed decoder.

use std::path::Path;

use burn::tensor::backend::Backend;
use kiln::nn::{BitLinear, BitLinearConfig, Linear, RmsNorm, TernaryLinear};
use kiln::ops::nf4::bnb::{Stored, StoredDtype};
use kiln::ops::ternary::{TernaryMatrix, TernaryWeight};
use kiln::ops::{rms_norm::RmsNormBackend, ternary::TernaryBackend};
use serde::Deserialize;

use super::build::{LinearShape, LoadOptions, MakeLinear, float_linear, load_made, read_norm};
use super::{Decoder, FloatDecoder};
use crate::config::Family;
use crate::error::{LoadError, Result};
use crate::loader::{ParamKind, ParamSource};

/// A decoder whose attention and MLP linears train as BitNet b1.58 layers.
pub type BitNetDecoder<B> = Decoder<B, BitLinear<B>>;
/// A decoder whose attention and MLP linears are packed ternary weights.
pub type TernaryDecoder<B> = Decoder<B, TernaryLinear<B>>;

/// How the linears are quantized: BitNet's defaults are one scale per weight and an RMSNorm on
/// each linear's input before its 8-bit quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitNetOptions {
    /// Output rows per weight scale; `None`: one per weight.
    pub group: Option<usize>,
    pub input_norm: bool,
}

impl Default for BitNetOptions {
    fn default() -> Self {
        Self { group: None, input_norm: true }
    }
}

/// Every attention and MLP linear of `model` as a [`BitLinear`] whose latent weight starts from
/// the float weight (training from scratch or continuing from a float checkpoint).
pub fn to_bitnet<B: TernaryBackend + RmsNormBackend>(model: FloatDecoder<B>, options: BitNetOptions) -> BitNetDecoder<B> {
    model.map_linears(|_, linear: Linear<B>| {
        let [d_input, d_output] = linear.weight.shape().dims();
        let config = BitLinearConfig::new(d_input, d_output)
            .with_bias(linear.bias.is_some())
            .with_group(options.group)
            .with_input_norm(options.input_norm);
        BitLinear::from_linear(&linear, &config)
    })
}

/// The trained decoder with its linears packed (quantized once; what the QAT forward computed).
pub fn pack_ternary<B: TernaryBackend + RmsNormBackend>(model: &BitNetDecoder<B>) -> TernaryDecoder<B> {
    model.clone().map_linears(|_, layer| layer.to_ternary())
}

/// Loads a BitNet checkpoint with packed ternary attention and MLP linears: HF's
/// `BitNetForCausalLM` (`quantization_config.linear_class` `bitlinear` or `autobitlinear`,
/// offline: packed weights; online: float weights, quantized here as transformers quantizes them
/// on every forward), a `bitnet` `.gguf` (its ternary weights packed as they are), or any other
/// float checkpoint or `.gguf`, whose linears are quantized per tensor.
/// The embedding, norms and head load in `options.dtype`.
pub fn load_bitnet<B: TernaryBackend + RmsNormBackend>(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<(Family, TernaryDecoder<B>)> {
    let mut maker = if dir.extension().is_some_and(|e| e == "gguf") { TernaryMaker::default() } else { TernaryMaker::from_config(dir)? };
    load_made(dir, options, device, &mut maker)
}

/// `config.json`'s `quantization_config` as transformers' `BitNetQuantConfig` writes it.
#[derive(Debug, Deserialize)]
struct QuantizationConfig {
    quant_method: String,
    #[serde(default = "bitlinear")]
    linear_class: String,
    #[serde(default = "offline")]
    quantization_mode: String,
    #[serde(default)]
    use_rms_norm: bool,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default)]
    modules_to_not_convert: Option<Vec<String>>,
}

fn bitlinear() -> String {
    "bitlinear".into()
}

fn offline() -> String {
    "offline".into()
}

fn default_eps() -> f64 {
    1e-6
}

/// How a packed `weight_scale` turns into kiln's scale `s` (`y = acc / (s_x · s)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum ScaleConvention {
    /// `BitLinear` divides by it: it is `s`.
    #[default]
    Divide,
    /// `AutoBitLinear` multiplies by it: it is `1 / s` (`mean|W|`).
    Multiply,
}

/// Makes [`TernaryLinear`]s: from HF's packed tensors where the checkpoint has them, else by
/// quantizing the float weight (one scale per tensor, BitNet's quantizer).
#[derive(Debug, Clone, Copy, Default)]
pub struct TernaryMaker {
    scale: ScaleConvention,
    /// The epsilon of an RMSNorm on each linear's input (`use_rms_norm`), if there is one.
    input_norm: Option<f64>,
}

impl TernaryMaker {
    /// Reads `quantization_config` from the checkpoint's `config.json` (none: float linears).
    pub fn from_config(dir: &Path) -> Result<Self> {
        let path = if dir.is_dir() { dir.join("config.json") } else { dir.to_path_buf() };
        let text = std::fs::read_to_string(&path).map_err(|e| LoadError::io(&path, e))?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| LoadError::malformed(&path, format!("not JSON: {e}")))?;
        let Some(q) = value.get("quantization_config").filter(|v| !v.is_null()) else { return Ok(Self::default()) };
        let field = |name: &str, message: String| LoadError::field(&path, format!("quantization_config.{name}"), message);
        let q = QuantizationConfig::deserialize(q).map_err(|e| LoadError::field(&path, "quantization_config", e.to_string()))?;
        if q.quant_method != "bitnet" {
            return Err(field("quant_method", format!("`{}` is not BitNet's (`bitnet`)", q.quant_method)));
        }
        let scale = match q.linear_class.as_str() {
            "bitlinear" => ScaleConvention::Divide,
            "autobitlinear" => ScaleConvention::Multiply,
            other => return Err(field("linear_class", format!("`{other}` is not supported (bitlinear, autobitlinear)"))),
        };
        if !matches!(q.quantization_mode.as_str(), "offline" | "online") {
            return Err(field("quantization_mode", format!("`{}` is not offline or online", q.quantization_mode)));
        }
        let kept = q.modules_to_not_convert.unwrap_or_default();
        if let Some(name) = kept.iter().find(|m| m.contains("self_attn") || m.contains("mlp")) {
            return Err(field("modules_to_not_convert", format!("keeps `{name}` float; kiln's BitNet decoder packs every attention and MLP linear")));
        }
        Ok(Self { scale, input_norm: q.use_rms_norm.then_some(q.rms_norm_eps) })
    }

    fn norm<B: Backend, S: ParamSource>(&self, source: &mut S, name: &str, width: usize, device: &B::Device) -> Result<Option<RmsNorm<B>>> {
        self.input_norm.map(|epsilon| read_norm(source, &format!("{name}.rms_norm"), width, epsilon, device)).transpose()
    }

    /// HF's packed `<name>.weight` (`[n/4, k]` bytes) with its `<name>.weight_scale`.
    fn hf_packed<S: ParamSource>(&self, source: &S, name: &str, n: usize, k: usize) -> Result<TernaryMatrix> {
        let path = source.origin().to_path_buf();
        let scale_name = format!("{name}.weight_scale");
        let scale = self.scale(source.stored(&scale_name), &scale_name, &path)?;
        let weight_name = format!("{name}.weight");
        let stored = source.stored(&weight_name).ok_or_else(|| LoadError::tensor(&path, &weight_name, "missing from the checkpoint"))?;
        let packed_shape = [n.div_ceil(4), k];
        if stored.dtype != StoredDtype::U8 || stored.shape != packed_shape {
            return Err(LoadError::tensor(&path, &weight_name, format!("stored {:?} {:?}; a packed ternary weight is U8 {packed_shape:?}", stored.dtype, stored.shape)));
        }
        TernaryMatrix::from_hf(stored.bytes, n, k, scale).map_err(|e| LoadError::tensor(&path, &weight_name, e.to_string()))
    }

    /// kiln's scale from `<name>.weight_scale` (one positive finite value of a float type).
    fn scale(&self, stored: Option<Stored<'_>>, name: &str, path: &Path) -> Result<f32> {
        let stored = stored.ok_or_else(|| LoadError::tensor(path, name, "missing from the checkpoint"))?;
        let one = stored.shape.iter().product::<usize>() == 1 && stored.bytes.len() == stored.dtype.size();
        let value = one.then(|| stored.dtype.read_f32(stored.bytes)).flatten().ok_or_else(|| LoadError::tensor(path, name, format!("expected one F32, F16 or BF16 value; stored {:?} {:?}", stored.dtype, stored.shape)))?;
        let scale = match self.scale {
            ScaleConvention::Divide => value,
            ScaleConvention::Multiply => 1.0 / value,
        };
        if !(scale.is_finite() && scale > 0.0) {
            return Err(LoadError::tensor(path, name, format!("{value} does not give a positive finite scale")));
        }
        Ok(scale)
    }
}

impl<B: TernaryBackend + RmsNormBackend> MakeLinear<B> for TernaryMaker {
    type Linear = TernaryLinear<B>;

    fn make<S: ParamSource>(&mut self, source: &mut S, name: &str, shape: LinearShape, device: &B::Device) -> Result<TernaryLinear<B>> {
        let LinearShape { d_input: k, d_output: n, bias } = shape;
        let norm = self.norm(source, name, k, device)?;
        let weight_name = format!("{name}.weight");
        let matrix = match source.ternary(&weight_name, n, k) {
            Some(matrix) => matrix?,
            None if source.contains(&format!("{name}.weight_scale")) => self.hf_packed(source, name, n, k)?,
            None => {
                let linear: Linear<B> = float_linear(source, name, shape, device)?;
                let weight = TernaryWeight::quantize(linear.weight.val().transpose(), n);
                return Ok(TernaryLinear::from_weight(weight, linear.bias.map(|b| b.val()), norm));
            }
        };
        let bias = bias.then(|| source.param::<B, 1>(&format!("{name}.bias"), [n], ParamKind::Bias, device)).transpose()?;
        Ok(TernaryLinear::from_weight(TernaryWeight::from_host(&matrix, device), bias, norm))
    }

    fn consumes(&self, name: &str) -> bool {
        name.ends_with(".weight_scale") || (self.input_norm.is_some() && name.ends_with(".rms_norm.weight"))
    }
}
