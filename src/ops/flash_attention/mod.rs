//! Flash attention: softmax attention that never materializes the score matrix, with causal
//! (bottom-right aligned) and sliding-window masks, logit softcapping, an additive bias, and GQA/MQA
//! without repeating K/V. Decoding (a few query tokens over a long cache) splits the KV length
//! over the GPU and merges the partial results.

mod backward;
mod cube;
mod fusion;
pub mod reference;
#[cfg(feature = "cuda")]
mod wgmma;

use burn::tensor::{Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::{prim, wrap};
use crate::error::{ensure, ensure_float, ensure_same_dtype};

/// Masking and logit options of an attention call. `Default` is plain non-causal attention with
/// scale `1/√head_dim`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AttentionOptions {
    /// Logit scale; `None` is `1/√head_dim`.
    pub scale: Option<f64>,
    /// Key `j` is visible to query `i` only if `j ≤ i + kv_len − q_len` (aligned to the end of
    /// the keys, so queries appended to a KV cache see the whole cache).
    pub causal: bool,
    /// Sliding window: key `j` is visible to query `i` only if `i + kv_len − q_len − j < window`.
    pub window: Option<usize>,
    /// Logit softcap `c`: logits become `c · tanh(logit / c)` (Gemma 2), before the bias.
    pub softcap: Option<f64>,
}

impl AttentionOptions {
    /// Causal attention with the default scale.
    pub fn causal() -> Self {
        Self { causal: true, ..Self::default() }
    }

    pub fn with_scale(self, scale: f64) -> Self {
        Self { scale: Some(scale), ..self }
    }

    pub fn with_window(self, window: usize) -> Self {
        Self { window: Some(window), ..self }
    }

    pub fn with_softcap(self, softcap: f64) -> Self {
        Self { softcap: Some(softcap), ..self }
    }

    /// The scale for heads of `head_dim`.
    pub fn scale_for(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (head_dim as f64).sqrt())
    }
}

/// Output of the forward: the attention output and the per-row log-sum-exp of the logits (f32
/// `[batch, q_heads, q_len]`; [`EMPTY_LSE`] for a row that sees no key), which the backward
/// reuses instead of the probabilities.
#[derive(Debug, Clone)]
pub struct AttentionOutput<B: Backend> {
    pub output: FloatTensor<B>,
    pub lse: FloatTensor<B>,
}

pub use kiln_kernels::flash_attention::EMPTY_LSE;

/// Backend support for flash attention. The default methods are the reference (which does
/// materialize the scores).
pub trait FlashAttentionBackend: Backend {
    /// Attention of q `[batch, q_heads, q_len, d]` over k, v `[batch, kv_heads, kv_len, d]`, with
    /// an optional bias already expanded to `[batch, q_heads, q_len, kv_len]`.
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: AttentionOptions,
    ) -> AttentionOutput<Self> {
        reference::forward::<Self>(q, k, v, bias, options)
    }

    /// `(dq, dk, dv)` from the forward's inputs, output, log-sum-exp and the output gradient.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_output: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Self>(q, k, v, bias, output, lse, d_output, options)
    }
}

crate::backend::reference_backends!(FlashAttentionBackend);

/// Softmax attention of `q: [batch, q_heads, q_len, head_dim]` over `k`, `v: [batch, kv_heads,
/// kv_len, head_dim]`, `q_heads` a multiple of `kv_heads` (GQA; query head `h` uses kv head
/// `h / (q_heads / kv_heads)`). `bias` is added to the logits and broadcasts to
/// `[batch, q_heads, q_len, kv_len]`; it is treated as a constant (a mask): no gradient flows
/// to it. Rows that see no key give 0.
///
/// # Panics
/// On mismatched shapes or dtypes, a zero window or a non-positive softcap, naming the shapes.
pub fn flash_attention<B: FlashAttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    bias: Option<Tensor<B, 4>>,
    options: AttentionOptions,
) -> Tensor<B, 4> {
    const OP: &str = "flash_attention";
    let (q, k, v) = (prim(q), prim(k), prim(v));
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let [batch, q_heads, q_len, head_dim] = [qs[0], qs[1], qs[2], qs[3]];
    let (kv_heads, kv_len) = (ks[1], ks[2]);
    ensure(ks == vs && ks[0] == batch && ks[3] == head_dim, OP, || {
        format!("q {:?}, k {:?} and v {:?} must be [batch, heads, seq, head_dim] with equal batch and head_dim, k and v equal", qs.as_slice(), ks.as_slice(), vs.as_slice())
    });
    ensure(kv_heads > 0 && q_heads % kv_heads == 0, OP, || {
        format!("q heads {q_heads} (q {:?}) must be a multiple of kv heads {kv_heads} (k {:?})", qs.as_slice(), ks.as_slice())
    });
    ensure_float(OP, "q", q.dtype());
    ensure_same_dtype(OP, &[("q", q.dtype()), ("k", k.dtype()), ("v", v.dtype())]);
    ensure(options.window != Some(0), OP, || "window must be at least 1".to_string());
    ensure(options.softcap.is_none_or(|c| c > 0.0), OP, || format!("softcap must be positive, got {:?}", options.softcap));
    let full = [batch, q_heads, q_len, kv_len];
    let bias = bias.map(|b| {
        let dims = b.dims();
        ensure(dims.iter().zip(full).all(|(&d, f)| d == f || d == 1), OP, || {
            format!("bias {dims:?} does not broadcast to [batch, q_heads, q_len, kv_len] = {full:?}")
        });
        ensure_same_dtype(OP, &[("q", q.dtype()), ("bias", b.dtype())]);
        prim(b.detach().expand(full))
    });
    wrap(B::flash_attention_forward(q, k, v, bias, options).output)
}
