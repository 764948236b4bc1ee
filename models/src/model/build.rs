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

/// Builds the decoder from `source`; each attention/MLP linear passes through `map` with its HF
/// module path as it is built (quantize or wrap while loading, one layer in memory at a time).
pub fn build<B: Backend, L: Module<B>, S: ParamSource>(
    config: &DecoderConfig,
    source: &mut S,
    device: &B::Device,
    mut map: impl FnMut(&str, Linear<B>) -> L,
) -> Result<Decoder<B, L>> {
    let c = config;
    let mut b = Builder { source, device };
    let embed = b.source.param::<B, 2>("model.embed_tokens.weight", [c.vocab_size, c.hidden_size], ParamKind::Embedding, device)?;
    let layers = (0..c.num_layers).map(|i| b.layer(c, i, &mut map)).collect::<Result<Vec<_>>>()?;
    let norm = b.norm("model.norm", c.hidden_size, c.rms_norm_eps)?;
    // A checkpoint may store `lm_head.weight` even when tied (it equals the embedding then).
    let lm_head = if c.tie_embeddings { None } else { Some(b.linear("lm_head", c.hidden_size, c.vocab_size, false)?) };
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
    fn linear<B: Backend<Device = D>>(&mut self, name: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Linear<B>> {
        let weight = self.source.param::<B, 2>(&format!("{name}.weight"), [d_in, d_out], ParamKind::Linear, self.device)?;
        let bias = bias.then(|| self.source.param::<B, 1>(&format!("{name}.bias"), [d_out], ParamKind::Bias, self.device)).transpose()?;
        Ok(Linear { weight: Param::from_tensor(weight), bias: bias.map(Param::from_tensor) })
    }

    fn norm<B: Backend<Device = D>>(&mut self, name: &str, width: usize, epsilon: f64) -> Result<RmsNorm<B>> {
        let weight = self.source.param::<B, 1>(&format!("{name}.weight"), [width], ParamKind::Norm, self.device)?;
        Ok(RmsNorm { weight: Param::from_tensor(weight), epsilon })
    }

    fn layer<B: Backend<Device = D>, L: Module<B>>(
        &mut self,
        c: &DecoderConfig,
        i: usize,
        map: &mut impl FnMut(&str, Linear<B>) -> L,
    ) -> Result<DecoderLayer<B, L>> {
        let p = format!("model.layers.{i}");
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let mut linear = |b: &mut Self, part: &str, d_in, d_out, bias| -> Result<L> {
            let name = format!("{p}.{part}");
            Ok(map(&name, b.linear(&name, d_in, d_out, bias)?))
        };
        let self_attn = Attention {
            q_proj: linear(self, "self_attn.q_proj", d, q, c.qkv_bias)?,
            k_proj: linear(self, "self_attn.k_proj", d, kv, c.qkv_bias)?,
            v_proj: linear(self, "self_attn.v_proj", d, kv, c.qkv_bias)?,
            o_proj: linear(self, "self_attn.o_proj", q, d, c.o_bias)?,
            q_norm: c.qk_norm.then(|| self.norm(&format!("{p}.self_attn.q_norm"), c.head_dim, c.rms_norm_eps)).transpose()?,
            k_norm: c.qk_norm.then(|| self.norm(&format!("{p}.self_attn.k_norm"), c.head_dim, c.rms_norm_eps)).transpose()?,
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
            down_proj: linear(self, "mlp.down_proj", f, d, c.mlp_bias)?,
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
    let limit = |config: DecoderConfig| match options.max_positions {
        Some(max) => config.with_max_positions(max.max(1)),
        None => config,
    };
    if dir.extension().is_some_and(|e| e == "gguf") {
        let (mut source, family, config) = GgufSource::open(dir, options.dtype)?;
        if let Some(name) = source.unexpected(&expected_names(&config)) {
            return Err(LoadError::tensor(dir, name, "in the file but not in the model its metadata describes"));
        }
        return Ok((family, build(&limit(config), &mut source, device, map)?));
    }
    let (family, config) = from_hf_json(dir)?;
    let mut source = SafetensorsSource::open(dir, options.dtype)?;
    check_all_used(&source, &config, dir)?;
    Ok((family, build(&limit(config), &mut source, device, map)?))
}

/// A checkpoint tensor the config does not explain means the config and weights disagree (a
/// bias the config omits, a layer too many): refuse rather than silently drop it.
fn check_all_used(source: &SafetensorsSource, config: &DecoderConfig, dir: &Path) -> Result<()> {
    let expected = expected_names(config);
    let unused = source.names().filter(|n| !expected.contains(*n) && !is_ignorable(n, config)).min();
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
    }
    names.into_iter().collect()
}
