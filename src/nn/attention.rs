use burn::config::Config;
use burn::module::Module;
use super::{Linear, LinearConfig};
use burn::tensor::{Tensor, backend::Backend, s};

use crate::ops::flash_attention::{AttentionOptions, FlashAttentionBackend, flash_attention};
use crate::ops::matmul::MatmulBackend;
use crate::ops::rope::{RopeBackend, RopeTable, rope};

/// Configuration of [`MultiHeadAttention`].
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    pub d_model: usize,
    pub n_heads: usize,
    /// Key/value heads: `n_heads` for multi-head, fewer for GQA, 1 for MQA.
    pub n_kv_heads: usize,
    /// Per-head size; `d_model / n_heads` when unset.
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Bias on the q/k/v projections (Qwen2 has it, Llama not).
    #[config(default = false)]
    pub qkv_bias: bool,
    /// Sliding-window size (Mistral, Qwen2 sliding layers).
    #[config(default = "None")]
    pub window: Option<usize>,
    /// Logit softcap (Gemma 2).
    #[config(default = "None")]
    pub softcap: Option<f64>,
}

impl MultiHeadAttentionConfig {
    /// # Panics
    /// If `n_kv_heads` does not divide `n_heads`, or `head_dim` is unset and `n_heads` does not
    /// divide `d_model`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> MultiHeadAttention<B> {
        crate::error::ensure(self.n_kv_heads > 0 && self.n_heads % self.n_kv_heads == 0, "MultiHeadAttention", || {
            format!("n_heads {} must be a multiple of n_kv_heads {}", self.n_heads, self.n_kv_heads)
        });
        let head_dim = self.head_dim.unwrap_or(self.d_model / self.n_heads);
        crate::error::ensure(head_dim > 0 && (self.head_dim.is_some() || self.d_model % self.n_heads == 0), "MultiHeadAttention", || {
            format!("d_model {} does not split into {} heads; set head_dim", self.d_model, self.n_heads)
        });
        let linear = |i, o, bias| LinearConfig::new(i, o).with_bias(bias).init(device);
        MultiHeadAttention {
            q: linear(self.d_model, self.n_heads * head_dim, self.qkv_bias),
            k: linear(self.d_model, self.n_kv_heads * head_dim, self.qkv_bias),
            v: linear(self.d_model, self.n_kv_heads * head_dim, self.qkv_bias),
            o: linear(self.n_heads * head_dim, self.d_model, false),
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim,
            window: self.window,
            softcap: self.softcap,
        }
    }
}

/// Causal self-attention with GQA, HF-layout RoPE on q and k, and an optional KV cache, running
/// on kiln's flash attention (forward and backward) and RoPE kernels.
#[derive(Module, Debug)]
pub struct MultiHeadAttention<B: Backend> {
    pub q: Linear<B>,
    pub k: Linear<B>,
    pub v: Linear<B>,
    pub o: Linear<B>,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    #[module(skip)]
    pub window: Option<usize>,
    #[module(skip)]
    pub softcap: Option<f64>,
}

/// Keys and values of past positions for one attention layer, in preallocated
/// `[batch, kv_heads, capacity, head_dim]` buffers that decoding appends to without copies of
/// the past.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    len: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for up to `capacity` positions of `attention`'s kv heads.
    pub fn new(attention: &MultiHeadAttention<B>, batch: usize, capacity: usize, device: &B::Device) -> Self {
        let shape = [batch, attention.n_kv_heads, capacity, attention.head_dim];
        Self { k: Tensor::zeros(shape, device), v: Tensor::zeros(shape, device), len: 0 }
    }

    /// Positions stored so far (the RoPE offset of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Store `k`, `v` (`[batch, kv_heads, new, head_dim]`) after the past and return all keys
    /// and values so far.
    fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let (start, end) = (self.len, self.len + k.dims()[2]);
        let capacity = self.k.dims()[2];
        crate::error::ensure(end <= capacity, "KvCache", || format!("{end} positions exceed the cache capacity {capacity}"));
        self.k = self.k.clone().slice_assign(s![.., .., start..end, ..], k);
        self.v = self.v.clone().slice_assign(s![.., .., start..end, ..], v);
        self.len = end;
        (self.k.clone().slice(s![.., .., 0..end, ..]), self.v.clone().slice(s![.., .., 0..end, ..]))
    }
}

impl<B: FlashAttentionBackend + RopeBackend + MatmulBackend> MultiHeadAttention<B> {
    /// Causal self-attention over `x: [batch, seq, d_model]`. With a cache, `x` holds the
    /// positions after those already cached, and its keys/values are appended.
    pub fn forward(&self, x: Tensor<B, 3>, rope_table: &RopeTable<B>, cache: Option<&mut KvCache<B>>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let offset = cache.as_ref().map_or(0, |c| c.len());
        let heads = |t: Tensor<B, 3>, n: usize| t.reshape([batch, seq, n, self.head_dim]);
        let q = rope(heads(self.q.forward(x.clone()), self.n_heads), rope_table, offset).swap_dims(1, 2);
        let k = rope(heads(self.k.forward(x.clone()), self.n_kv_heads), rope_table, offset).swap_dims(1, 2);
        let v = heads(self.v.forward(x), self.n_kv_heads).swap_dims(1, 2);
        let (k, v) = match cache {
            Some(cache) => cache.append(k, v),
            None => (k, v),
        };
        let options = AttentionOptions { causal: true, window: self.window, softcap: self.softcap, scale: None };
        let out = flash_attention(q, k, v, None, options);
        self.o.forward(out.swap_dims(1, 2).reshape([batch, seq, self.n_heads * self.head_dim]))
    }
}
