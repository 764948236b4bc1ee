//! Builds a [`Decoder`] from a config and a [`ParamSource`], asking for each parameter by its HF
//! name: the one construction path of random init, safetensors and future formats.

use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::{FloatDType, backend::Backend};
use kiln::nn::{Linear, RmsNorm};
use kiln::ops::RopeTable;

use super::{Attention, Decoder, DecoderLayer, FloatDecoder};
use crate::config::{DecoderConfig, Family, from_hf_json};
use crate::error::{LoadError, Result};
use crate::loader::{GgufSource, ParamKind, ParamSource, RandomInit, SafetensorsSource};

/// Makes each attention/MLP linear of a decoder being built, from the source's tensors under the
/// layer's HF module path (`model.layers.3.mlp.up_proj`).
pub trait MakeLinear<B: Backend> {
    type Linear: Module<B>;

    fn make<S: ParamSource>(&mut self, source: &mut S, name: &str, shape: LinearShape, device: &B::Device) -> Result<Self::Linear>;

    /// Whether a stored tensor that is not one of the float model's belongs to this maker's
    /// layers (a quantized format's extra tensors), so the loader does not refuse it.
    fn consumes(&self, _name: &str) -> bool {
        false
    }
}

/// The shape of a linear layer being built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    pub d_input: usize,
    pub d_output: usize,
    pub bias: bool,
}

/// Float linears read from the source, then passed through a function of the layer's name.
pub struct MapFloat<F>(pub F);

impl<B: Backend, L: Module<B>, F: FnMut(&str, Linear<B>) -> L> MakeLinear<B> for MapFloat<F> {
    type Linear = L;

    fn make<S: ParamSource>(&mut self, source: &mut S, name: &str, shape: LinearShape, device: &B::Device) -> Result<L> {
        Ok((self.0)(name, float_linear(source, name, shape, device)?))
    }
}

/// A float linear from `<name>.weight` (and `<name>.bias`). A 4-bit bitsandbytes or packed
/// ternary weight there is refused with a pointer to its loader.
pub fn float_linear<B: Backend, S: ParamSource>(source: &mut S, name: &str, shape: LinearShape, device: &B::Device) -> Result<Linear<B>> {
    let weight_name = format!("{name}.weight");
    if kiln::ops::nf4::bnb::stored_4bit(&weight_name, |n| source.contains(n)) {
        return Err(LoadError::tensor(source.origin(), weight_name, "a bitsandbytes 4-bit weight: load the checkpoint with `load_nf4`"));
    }
    if source.contains(&format!("{name}.weight_scale")) {
        return Err(LoadError::tensor(source.origin(), weight_name, "a packed BitNet weight: load the checkpoint with `load_bitnet`"));
    }
    let LinearShape { d_input, d_output, bias } = shape;
    let weight = source.param::<B, 2>(&weight_name, [d_input, d_output], ParamKind::Linear, device)?;
    let bias = bias.then(|| source.param::<B, 1>(&format!("{name}.bias"), [d_output], ParamKind::Bias, device)).transpose()?;
    Ok(Linear { weight: Param::from_tensor(weight), bias: bias.map(Param::from_tensor) })
}

/// The RMSNorm whose scale is `<name>.weight` (`[width]`).
pub(crate) fn read_norm<B: Backend, S: ParamSource>(source: &mut S, name: &str, width: usize, epsilon: f64, device: &B::Device) -> Result<RmsNorm<B>> {
    let weight = source.param::<B, 1>(&format!("{name}.weight"), [width], ParamKind::Norm, device)?;
    Ok(RmsNorm { weight: Param::from_tensor(weight), epsilon })
}

/// Builds the decoder from `source`; each attention/MLP linear passes through `map` with its HF
/// module path as it is built (quantize or wrap while loading, one layer in memory at a time).
pub fn build<B: Backend, L: Module<B>, S: ParamSource>(
    config: &DecoderConfig,
    source: &mut S,
    device: &B::Device,
    map: impl FnMut(&str, Linear<B>) -> L,
) -> Result<Decoder<B, L>> {
    build_with(config, source, device, &mut MapFloat(map))
}

/// [`build`] with each linear made by `maker` from the source's tensors.
pub fn build_with<B: Backend, M: MakeLinear<B>, S: ParamSource>(
    config: &DecoderConfig,
    source: &mut S,
    device: &B::Device,
    maker: &mut M,
) -> Result<Decoder<B, M::Linear>> {
    let c = config;
    let mut b = Builder { source, device };
    let embed = b.source.param::<B, 2>("model.embed_tokens.weight", [c.vocab_size, c.hidden_size], ParamKind::Embedding, device)?;
    let layers = (0..c.num_layers).map(|i| b.layer(c, i, maker)).collect::<Result<Vec<_>>>()?;
    let norm = b.norm("model.norm", c.hidden_size, c.rms_norm_eps)?;
    // A checkpoint may store `lm_head.weight` even when tied (it equals the embedding then).
    let head = LinearShape { d_input: c.hidden_size, d_output: c.vocab_size, bias: false };
    let lm_head = if c.tie_embeddings { None } else { Some(float_linear(b.source, "lm_head", head, device)?) };
    Ok(Decoder {
        embed_tokens: Embedding { weight: Param::from_tensor(embed) },
        layers,
        norm,
        lm_head,
        rope: RopeTable::from_inv_freq(&c.rope_inv_freq(), c.max_positions, device),
        config: c.clone(),
    })
}

struct Builder<'a, S, D> {
    source: &'a mut S,
    device: &'a D,
}

impl<S: ParamSource, D> Builder<'_, S, D> {
    fn norm<B: Backend<Device = D>>(&mut self, name: &str, width: usize, epsilon: f64) -> Result<RmsNorm<B>> {
        read_norm(self.source, name, width, epsilon, self.device)
    }

    fn layer<B: Backend<Device = D>, M: MakeLinear<B>>(&mut self, c: &DecoderConfig, i: usize, maker: &mut M) -> Result<DecoderLayer<B, M::Linear>> {
        let p = format!("model.layers.{i}");
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let mut linear = |b: &mut Self, part: &str, d_input, d_output, bias| -> Result<M::Linear> {
            maker.make(b.source, &format!("{p}.{part}"), LinearShape { d_input, d_output, bias }, b.device)
        };
        let self_attn = Attention {
            q_proj: linear(self, "self_attn.q_proj", d, q, c.qkv_bias)?,
            k_proj: linear(self, "self_attn.k_proj", d, kv, c.qkv_bias)?,
            v_proj: linear(self, "self_attn.v_proj", d, kv, c.qkv_bias)?,
            o_proj: linear(self, "self_attn.o_proj", q, d, c.o_bias)?,
            q_norm: c.qk_norm.then(|| self.norm(&format!("{p}.self_attn.q_norm"), c.head_dim, c.rms_norm_eps)).transpose()?,
            k_norm: c.qk_norm.then(|| self.norm(&format!("{p}.self_attn.k_norm"), c.head_dim, c.rms_norm_eps)).transpose()?,
            sub_norm: c.sub_norms.then(|| self.norm(&format!("{p}.self_attn.attn_sub_norm"), q, c.rms_norm_eps)).transpose()?,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            window: c.window(i),
        };
        Ok(DecoderLayer {
            input_layernorm: self.norm(&format!("{p}.input_layernorm"), d, c.rms_norm_eps)?,
            self_attn,
            post_attention_layernorm: self.norm(&format!("{p}.post_attention_layernorm"), d, c.rms_norm_eps)?,
            gate_proj: linear(self, "mlp.gate_proj", d, f, c.mlp_bias)?,
            up_proj: linear(self, "mlp.up_proj", d, f, c.mlp_bias)?,
            ffn_sub_norm: c.sub_norms.then(|| self.norm(&format!("{p}.mlp.ffn_sub_norm"), f, c.rms_norm_eps)).transpose()?,
            down_proj: linear(self, "mlp.down_proj", f, d, c.mlp_bias)?,
            activation: c.activation,
        })
    }
}

impl DecoderConfig {
    /// A randomly initialized model (HF's init: N(0, 0.02²) weights, unit norms) in f32.
    pub fn init<B: Backend>(&self, device: &B::Device) -> FloatDecoder<B> {
        build(self, &mut RandomInit::default(), device, |_, l| l).expect("random initialization cannot fail")
    }
}

/// How to load a checkpoint.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The dtype parameters are converted to.
    pub dtype: FloatDType,
    /// Caps the positions the RoPE tables (and so the caches) cover; `None`: the config's
    /// `max_position_embeddings`.
    pub max_positions: Option<usize>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { dtype: FloatDType::F32, max_positions: None }
    }
}

/// Loads a HF checkpoint directory (`config.json` + safetensors, single or sharded) or a `.gguf`
/// file, with float linears.
pub fn load<B: Backend>(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<(Family, FloatDecoder<B>)> {
    load_with(dir, options, device, |_, l| l)
}

/// [`load`], passing each attention/MLP linear through `map` as it is loaded.
pub fn load_with<B: Backend, L: Module<B>>(
    dir: &Path,
    options: &LoadOptions,
    device: &B::Device,
    map: impl FnMut(&str, Linear<B>) -> L,
) -> Result<(Family, Decoder<B, L>)> {
    load_made(dir, options, device, &mut MapFloat(map))
}

/// [`load`] with each attention/MLP linear made by `maker` from the checkpoint's tensors.
pub fn load_made<B: Backend, M: MakeLinear<B>>(dir: &Path, options: &LoadOptions, device: &B::Device, maker: &mut M) -> Result<(Family, Decoder<B, M::Linear>)> {
    let limit = |config: DecoderConfig| match options.max_positions {
        Some(max) => config.with_max_positions(max.max(1)),
        None => config,
    };
    if dir.extension().is_some_and(|e| e == "gguf") {
        let (mut source, family, config) = GgufSource::open(dir, options.dtype)?;
        if let Some(name) = source.unexpected(&expected_names(&config)) {
            return Err(LoadError::tensor(dir, name, "in the file but not in the model its metadata describes"));
        }
        return Ok((family, build_with(&limit(config), &mut source, device, maker)?));
    }
    let (family, config) = from_hf_json(dir)?;
    let mut source = SafetensorsSource::open(dir, options.dtype)?;
    check_all_used(&source, &config, dir, |n| maker.consumes(n))?;
    Ok((family, build_with(&limit(config), &mut source, device, maker)?))
}

/// A checkpoint tensor the config does not explain means the config and weights disagree (a
/// bias the config omits, a layer too many): refuse rather than silently drop it. `consumed`:
/// names the linears' maker reads itself ([`MakeLinear::consumes`]). Every loader of HF
/// directories calls it before building.
pub fn check_all_used(source: &SafetensorsSource, config: &DecoderConfig, dir: &Path, consumed: impl Fn(&str) -> bool) -> Result<()> {
    if let Some(name) = source.names().filter(|n| kiln::ops::nf4::bnb::is_state(n) && !consumed(n)).min() {
        return Err(LoadError::tensor(dir, name, "a bitsandbytes 4-bit checkpoint: load it with `load_nf4`"));
    }
    if let Some(name) = source.names().filter(|n| n.ends_with(".weight_scale") && !consumed(n)).min() {
        return Err(LoadError::tensor(dir, name, "a packed BitNet checkpoint: load it with `load_bitnet`"));
    }
    let expected = expected_names(config);
    let unused = source.names().filter(|n| !expected.contains(*n) && !is_ignorable(n, config) && !consumed(n)).min();
    match unused {
        Some(name) => Err(LoadError::tensor(dir, name, "in the checkpoint but not in the model its config.json describes")),
        None => Ok(()),
    }
}

/// Stored tensors a loader may skip: rotary caches of old exports, a tied head's copy.
fn is_ignorable(name: &str, config: &DecoderConfig) -> bool {
    name.ends_with("rotary_emb.inv_freq") || (config.tie_embeddings && name == "lm_head.weight")
}

/// Every tensor name the config's model has.
pub fn expected_names(c: &DecoderConfig) -> std::collections::HashSet<String> {
    let mut names = vec!["model.embed_tokens.weight".to_string(), "model.norm.weight".to_string()];
    if !c.tie_embeddings {
        names.push("lm_head.weight".into());
    }
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        let biased = |part: &str, bias: bool| {
            let mut v = vec![format!("{p}.{part}.weight")];
            if bias {
                v.push(format!("{p}.{part}.bias"));
            }
            v
        };
        names.extend(["input_layernorm", "post_attention_layernorm"].map(|n| format!("{p}.{n}.weight")));
        for part in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] {
            names.extend(biased(part, c.qkv_bias));
        }
        names.extend(biased("self_attn.o_proj", c.o_bias));
        for part in ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"] {
            names.extend(biased(part, c.mlp_bias));
        }
        if c.qk_norm {
            names.extend(["q_norm", "k_norm"].map(|n| format!("{p}.self_attn.{n}.weight")));
        }
        if c.sub_norms {
            names.extend(["self_attn.attn_sub_norm", "mlp.ffn_sub_norm"].map(|n| format!("{p}.{n}.weight")));
        }
    }
    names.into_iter().collect()
}
