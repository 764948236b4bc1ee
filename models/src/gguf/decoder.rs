//! What a decoder checkpoint's GGUF metadata and tensor names mean in HF's terms: the
//! hyperparameters, tensor names, and the Q/K row order llama.cpp's converter permuted.

use super::{GgufFile, Value};
use crate::error::{LoadError, Result};

impl GgufFile {
    /// The decoder hyperparameters under `{general.architecture}.*`, and the vocabulary size.
    pub fn decoder_fields(&self) -> Result<GgufModelInfo> {
        let arch = self.str("general.architecture")?.to_string();
        let k = |s: &str| format!("{arch}.{s}");
        let head_count = self.per_layer_uniform(&k("attention.head_count"))?;
        let head_count_kv = match self.get(&k("attention.head_count_kv")) {
            Some(_) => self.per_layer_uniform(&k("attention.head_count_kv"))?,
            None => head_count,
        };
        let embedding_length = self.u64(&k("embedding_length"))?;
        let key_length = self.opt_u64(&k("attention.key_length"))?;
        let head_dim = match key_length {
            Some(d) => d,
            None if head_count > 0 => embedding_length / head_count,
            None => {
                return Err(LoadError::field(&self.path, k("attention.head_count"), "is 0"));
            }
        };
        let rope_scaling = match self.opt_str(&k("rope.scaling.type"))? {
            None | Some("none") => None,
            Some(kind) => Some(RopeScaling {
                kind: kind.to_string(),
                factor: self.opt_f64(&k("rope.scaling.factor"))?,
                original_context_length: self.opt_u64(&k("rope.scaling.original_context_length"))?,
            }),
        };
        let vocab_size = match self.get("tokenizer.ggml.tokens") {
            Some(_) => self.array("tokenizer.ggml.tokens")?.len(),
            None => match self.opt_u64(&k("vocab_size"))? {
                Some(v) => {
                    usize::try_from(v).map_err(|_| LoadError::field(&self.path, k("vocab_size"), "too large"))?
                }
                None => {
                    return Err(LoadError::field(&self.path, "tokenizer.ggml.tokens", "missing (and no vocab_size)"));
                }
            },
        };
        let ffn = self.per_layer_uniform(&k("feed_forward_length"))?;
        Ok(GgufModelInfo {
            context_length: self.u64(&k("context_length"))?,
            embedding_length,
            block_count: self.u64(&k("block_count"))?,
            feed_forward_length: ffn,
            head_count,
            head_count_kv,
            rms_norm_eps: self.f64(&k("attention.layer_norm_rms_epsilon"))?,
            rope_freq_base: self.opt_f64(&k("rope.freq_base"))?.unwrap_or(10000.0),
            key_length,
            value_length: self.opt_u64(&k("attention.value_length"))?,
            head_dim,
            rope_dimension_count: self.opt_u64(&k("rope.dimension_count"))?,
            rope_scaling,
            sliding_window: self.opt_u64(&k("attention.sliding_window"))?,
            hidden_activation: self.opt_str(&k("hidden_activation"))?.map(str::to_string),
            vocab_size,
            bos_token_id: self.opt_u64("tokenizer.ggml.bos_token_id")?,
            eos_token_id: self.opt_u64("tokenizer.ggml.eos_token_id")?,
            tied_embeddings: !self.contains("output.weight"),
            has_rope_freqs: self.contains("rope_freqs.weight"),
            architecture: arch,
        })
    }

    /// An integer, or an array of per-layer integers that are all equal.
    fn per_layer_uniform(&self, key: &str) -> Result<u64> {
        match self.required(key)? {
            Value::Array(a) => {
                let v = a.to_u64_vec().ok_or_else(|| self.wrong_type(key, "integers", &Value::Array(a.clone())))?;
                match v.first() {
                    Some(&x) if v.iter().all(|&y| y == x) => Ok(x),
                    Some(_) => Err(LoadError::field(&self.path, key, format!("differs between layers: {v:?}"))),
                    None => Err(LoadError::field(&self.path, key, "empty array")),
                }
            }
            _ => self.u64(key),
        }
    }
}

/// How RoPE is scaled (`{arch}.rope.scaling.*`). Llama 3's scaling is not here: llama.cpp stores
/// it as the tensor `rope_freqs.weight` (per-frequency divisors), see [`GgufModelInfo::has_rope_freqs`].
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    /// `"linear"`, `"yarn"`, `"longrope"`, ...
    pub kind: String,
    pub factor: Option<f64>,
    pub original_context_length: Option<u64>,
}

/// A decoder's hyperparameters as a GGUF file states them.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufModelInfo {
    /// `general.architecture`: `"llama"` (also Mistral), `"qwen2"`, `"qwen3"`, `"bitnet"`, ...
    pub architecture: String,
    pub context_length: u64,
    /// Hidden size.
    pub embedding_length: u64,
    /// Layers.
    pub block_count: u64,
    /// Intermediate size.
    pub feed_forward_length: u64,
    pub head_count: u64,
    /// `head_count` when the file does not say.
    pub head_count_kv: u64,
    pub rms_norm_eps: f64,
    /// RoPE theta (10000 when the file does not say).
    pub rope_freq_base: f64,
    /// `attention.key_length` as stored.
    pub key_length: Option<u64>,
    pub value_length: Option<u64>,
    /// `key_length`, else `embedding_length / head_count`.
    pub head_dim: u64,
    pub rope_dimension_count: Option<u64>,
    pub rope_scaling: Option<RopeScaling>,
    /// `attention.sliding_window` (llama.cpp's converter does not write it for Mistral).
    pub sliding_window: Option<u64>,
    /// `hidden_activation`: the MLP gate's activation by HF's name (`relu2` for BitNet b1.58
    /// 2B-4T); llama.cpp takes SiLU where it is absent.
    pub hidden_activation: Option<String>,
    /// The length of `tokenizer.ggml.tokens` (else `{arch}.vocab_size`).
    pub vocab_size: usize,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    /// No `output.weight`: the head is the token embedding.
    pub tied_embeddings: bool,
    /// The file holds `rope_freqs.weight` (Llama 3.1 RoPE scaling, as frequency divisors).
    pub has_rope_freqs: bool,
}

/// The GGUF (llama.cpp) name of the HF tensor `hf_name`, for Llama/Mistral/Qwen2/Qwen3/BitNet
/// decoders.
pub fn gguf_tensor_name(hf_name: &str) -> Option<String> {
    match hf_name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) || (layer.len() > 1 && layer.starts_with('0')) {
        return None;
    }
    let (module, suffix) = rest.rsplit_once('.')?;
    let name = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "self_attn.attn_sub_norm" => "attn_sub_norm",
        "mlp.ffn_sub_norm" => "ffn_sub_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    let suffix_ok = match suffix {
        "weight" => true,
        "bias" => (name.starts_with("attn_") || name.starts_with("ffn_")) && !name.ends_with("_norm"),
        _ => false,
    };
    suffix_ok.then(|| format!("blk.{layer}.{name}.{suffix}"))
}

/// Undoes llama.cpp's `LlamaModel.permute` of a Q or K projection (`llama` architecture only; not
/// Qwen2/Qwen3, which store HF's layout).
///
/// `data` is `rows × cols` row-major (HF `[out, in]`; for a bias `cols = 1`); `n_head` is the
/// attention head count for Q and the KV head count for K. The converter reshapes the rows to
/// `[n_head, 2, head_dim / 2]` and swaps the last two axes, so stored row `h·hd + 2i + j` is HF
/// row `h·hd + j·hd/2 + i`. Whole rows move, so `T` may also be raw bytes of quantized rows
/// (`cols` = bytes per row). `None` if the sizes do not fit (`rows` not a multiple of
/// `2 · n_head`, or `data.len() != rows · cols`).
pub fn unpermute_qk<T: Copy>(data: &[T], rows: usize, cols: usize, n_head: usize) -> Option<Vec<T>> {
    if n_head == 0 || !rows.is_multiple_of(n_head.checked_mul(2)?) || data.len() != rows.checked_mul(cols)? {
        return None;
    }
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = Vec::with_capacity(data.len());
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let stored = h * head_dim + 2 * i + j;
                out.extend_from_slice(&data[stored * cols..(stored + 1) * cols]);
            }
        }
    }
    Some(out)
}
