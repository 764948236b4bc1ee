//! GGUF checkpoints (llama.cpp's format) as a [`ParamSource`]: tensors dequantized to f32 on load
//! (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, TQ1_0, TQ2_0), renamed from HF to GGUF names, Q/K rows put back in
//! HF order where llama.cpp's converter permuted them (the `llama` architecture), and the config
//! read from the metadata.
//!
//! llama.cpp's `bitnet` architecture (BitNet b1.58) stores each attention/MLP weight as its
//! ternary values (`W̃ / s`, in any type; TQ1_0/TQ2_0 for the packed files), optionally with a
//! one-value `<name>.scale` tensor that multiplies the product. Float loading multiplies it into
//! the weight; [`ParamSource::ternary`] packs the weight exactly for `load_bitnet`.

use std::path::Path;

use burn::tensor::{FloatDType, Tensor, TensorData, backend::Backend};

use super::{ParamKind, ParamSource, transpose_bytes, upload};
use crate::config::{ACTIVATIONS, DecoderConfig, Family, activation_named};
use crate::error::{LoadError, Result};
use crate::gguf::{GgufFile, gguf_tensor_name, ternary, unpermute_qk};
use kiln::ops::{rope::RopeScaling, swiglu::GluActivation, ternary::TernaryMatrix};

/// The tensors of a GGUF file, dequantized on demand into a chosen float dtype.
pub struct GgufSource {
    file: GgufFile,
    dtype: FloatDType,
    /// Heads and kv heads when Q/K rows are stored permuted (llama architecture).
    permuted_heads: Option<(usize, usize)>,
    /// The linears hold ternary values (the `bitnet` architecture).
    ternary: bool,
}

impl GgufSource {
    /// Opens `path` and reads its decoder config from the metadata.
    pub fn open(path: &Path, dtype: FloatDType) -> Result<(Self, Family, DecoderConfig)> {
        let file = GgufFile::open(path)?;
        let (family, config) = config_from_gguf(&file)?;
        let arch = file.str("general.architecture")?;
        let permuted_heads = (arch == "llama").then_some((config.num_heads, config.num_kv_heads));
        let ternary = arch == "bitnet";
        Ok((Self { file, dtype, permuted_heads, ternary }, family, config))
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// GGUF tensor names that the config's model does not explain (besides `rope_freqs.weight`
    /// and the linears' `.scale`s).
    pub(crate) fn unexpected(&self, expected: &std::collections::HashSet<String>) -> Option<String> {
        let known: std::collections::HashSet<String> = expected.iter().filter_map(|n| gguf_tensor_name(n)).collect();
        let explained = |n: &String| known.contains(n) || n == "rope_freqs.weight" || n.strip_suffix(".scale").is_some_and(|w| known.contains(&format!("{w}.weight")));
        self.file.tensors().iter().map(|t| t.name.clone()).filter(|n| !explained(n)).min()
    }

    /// The value of the `.scale` tensor beside the weight `stored_name`, if the file has one
    /// (one finite nonzero number).
    fn weight_scale(&self, stored_name: &str) -> Result<Option<f32>> {
        let Some(name) = stored_name.strip_suffix(".weight").map(|w| format!("{w}.scale")).filter(|n| self.file.contains(n)) else {
            return Ok(None);
        };
        match self.file.tensor_f32(&name)?.1[..] {
            [v] if v.is_finite() && v != 0.0 => Ok(Some(v)),
            ref other => Err(LoadError::tensor(self.file.path(), &name, format!("expected one finite nonzero value, found {other:?}"))),
        }
    }

    /// The tensor `stored_name` as f32 (its dims, innermost first), times its `.scale` if the
    /// file has one: BitNet's GGUF files store a ternary weight and its scale apart.
    fn scaled_f32(&self, stored_name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (dims, mut values) = self.file.tensor_f32(stored_name)?;
        if let Some(scale) = self.weight_scale(stored_name)? {
            values.iter_mut().for_each(|v| *v *= scale);
        }
        Ok((dims, values))
    }
}

impl ParamSource for GgufSource {
    fn param<B: Backend, const D: usize>(&mut self, name: &str, shape: [usize; D], kind: ParamKind, device: &B::Device) -> Result<Tensor<B, D>> {
        let path = self.file.path().to_path_buf();
        let stored_name = gguf_tensor_name(name).ok_or_else(|| LoadError::tensor(&path, name, "has no GGUF name"))?;
        let (dims, mut data) = self.scaled_f32(&stored_name)?;
        // GGUF lists dims innermost first: HF's [out, in] is [in, out] there.
        let hf_shape: Vec<usize> = if kind == ParamKind::Linear { shape.iter().rev().copied().collect() } else { shape.to_vec() };
        let stored: Vec<usize> = dims.iter().rev().copied().collect();
        if stored != hf_shape {
            return Err(LoadError::tensor(&path, &stored_name, format!("shape {stored:?} (row-major); the config needs {hf_shape:?}")));
        }
        if let Some((heads, kv_heads)) = self.permuted_heads {
            let n_head = if name.contains("self_attn.q_proj") { Some(heads) } else if name.contains("self_attn.k_proj") { Some(kv_heads) } else { None };
            if let Some(n_head) = n_head {
                let (rows, cols) = (hf_shape[0], hf_shape.get(1).copied().unwrap_or(1));
                data = unpermute_qk(&data, rows, cols, n_head)
                    .ok_or_else(|| LoadError::tensor(&path, &stored_name, format!("{rows} rows do not split into {n_head} rotary heads")))?;
            }
        }
        let data = if kind == ParamKind::Linear {
            let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            let t = transpose_bytes(&bytes, hf_shape[0], hf_shape[1], 4);
            TensorData::from_bytes_vec(t, shape, burn::tensor::DType::F32)
        } else {
            TensorData::new(data, shape)
        };
        Ok(upload(data, self.dtype, device))
    }

    fn contains(&self, name: &str) -> bool {
        gguf_tensor_name(name).is_some_and(|n| self.file.contains(&n))
    }

    fn ternary(&self, name: &str, n: usize, k: usize) -> Option<Result<TernaryMatrix>> {
        self.ternary.then(|| {
            let path = self.file.path();
            let stored_name = gguf_tensor_name(name).ok_or_else(|| LoadError::tensor(path, name, "has no GGUF name"))?;
            let (dims, values) = self.scaled_f32(&stored_name)?;
            if dims != [k, n] {
                return Err(LoadError::tensor(path, &stored_name, format!("dims {dims:?}; the config needs [{k}, {n}] (GGUF order)")));
            }
            ternary::from_values(&values, n, k).map_err(|e| LoadError::tensor(path, &stored_name, e))
        })
    }

    fn origin(&self) -> &Path {
        self.file.path()
    }
}

/// The decoder config a GGUF file's metadata (and tensor list) describes.
pub fn config_from_gguf(file: &GgufFile) -> Result<(Family, DecoderConfig)> {
    let info = file.decoder_fields()?;
    let path = file.path();
    let family = match info.architecture.as_str() {
        // llama.cpp stores Mistral as `llama`; a sliding window tells them apart.
        "llama" if info.sliding_window.is_some() => Family::Mistral,
        "llama" => Family::Llama,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        "bitnet" => Family::BitNet,
        other => return Err(LoadError::field(path, "general.architecture", format!("`{other}` is not supported (llama, qwen2, qwen3, bitnet)"))),
    };
    let activation = match &info.hidden_activation {
        None => GluActivation::Silu,
        Some(name) => activation_named(name).ok_or_else(|| {
            LoadError::field(path, format!("{}.hidden_activation", info.architecture), format!("`{name}` is not supported ({ACTIVATIONS})"))
        })?,
    };
    let size = |field: &str, v: u64| usize::try_from(v).map_err(|_| LoadError::field(path, field, format!("{v} does not fit in memory sizes")));
    let has = |name: &str| file.contains(name);
    let rope_scaling = match &info.rope_scaling {
        None => RopeScaling::None,
        Some(s) if s.kind == "none" => RopeScaling::None,
        Some(s) if s.kind == "linear" => RopeScaling::Linear {
            factor: s.factor.ok_or_else(|| LoadError::field(path, format!("{}.rope.scaling.factor", info.architecture), "missing"))?,
        },
        Some(s) => return Err(LoadError::field(path, format!("{}.rope.scaling.type", info.architecture), format!("`{}` is not supported (linear)", s.kind))),
    };
    let rope_freq_factors = if info.has_rope_freqs {
        let (_, factors) = file.tensor_f32("rope_freqs.weight")?;
        Some(factors.into_iter().map(f64::from).collect())
    } else {
        None
    };
    let config = DecoderConfig {
        vocab_size: info.vocab_size,
        hidden_size: size("embedding_length", info.embedding_length)?,
        intermediate_size: size("feed_forward_length", info.feed_forward_length)?,
        num_layers: size("block_count", info.block_count)?,
        num_heads: size("attention.head_count", info.head_count)?,
        num_kv_heads: size("attention.head_count_kv", info.head_count_kv)?,
        head_dim: size("attention.key_length", info.head_dim)?,
        rms_norm_eps: info.rms_norm_eps,
        rope_theta: info.rope_freq_base,
        rope_scaling,
        rope_freq_factors,
        max_positions: size("context_length", info.context_length)?.max(1),
        qkv_bias: has("blk.0.attn_q.bias"),
        o_bias: has("blk.0.attn_output.bias"),
        mlp_bias: has("blk.0.ffn_gate.bias"),
        qk_norm: has("blk.0.attn_q_norm.weight"),
        activation,
        sub_norms: family == Family::BitNet,
        sliding_window: info.sliding_window.map(|w| size("attention.sliding_window", w)).transpose()?,
        sliding_layers: None,
        tie_embeddings: info.tied_embeddings,
        bos_token_id: info.bos_token_id.and_then(|t| u32::try_from(t).ok()),
        eos_token_ids: info.eos_token_id.and_then(|t| u32::try_from(t).ok()).into_iter().collect(),
    };
    config.validate().map_err(|m| LoadError::malformed(path, m))?;
    Ok((family, config))
}
