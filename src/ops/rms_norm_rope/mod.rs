//! Per-head RMSNorm + RoPE on q and k in one launch: the QK-norm block of Qwen3, Gemma 3 and
//! OLMo 2, `q ← rope(rms_norm(q) · γ_q)`, `k ← rope(rms_norm(k) · γ_k)`, each head normalized over
//! `head_dim`.

mod backward;
mod cube;
mod fusion;
pub mod reference;

use burn::tensor::{Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::rope::{RopeBackend, RopeTable, validate_heads};
use super::{prim, wrap};
use crate::error::{ensure, ensure_same_dtype};

/// Result of the fused forward on primitives.
#[derive(Debug, Clone)]
pub struct RmsNormRopeOutput<B: Backend> {
    pub q: FloatTensor<B>,
    pub k: FloatTensor<B>,
    /// f32 `[batch·seq·q_heads]`, saved for the backward.
    pub q_rstd: FloatTensor<B>,
    /// f32 `[batch·seq·kv_heads]`.
    pub k_rstd: FloatTensor<B>,
}

/// Backend support for the fused QK-norm + RoPE. The default methods are the reference.
pub trait RmsNormRopeBackend: RopeBackend {
    /// `q: [batch, seq, q_heads, head_dim]`, `k: [batch, seq, kv_heads, head_dim]` (last axis
    /// contiguous), `γ: [head_dim]`, f32 tables `[positions, head_dim/2]`. Outputs contiguous.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_rope_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        q_gamma: FloatTensor<Self>,
        k_gamma: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
        epsilon: f64,
    ) -> RmsNormRopeOutput<Self> {
        reference::forward::<Self>(q, k, q_gamma, k_gamma, cos, sin, offset, epsilon)
    }

    /// `(dx, dγ)` for one of q or k, from its input, `γ`, saved `rstd` and the output gradient.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_rope_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Self>(x, gamma, rstd, dy, cos, sin, offset)
    }
}

crate::backend::reference_backends!(RmsNormRopeBackend);

/// `(rope(rms_norm(q) · γ_q), rope(rms_norm(k) · γ_k))` per head, positions `offset..offset+seq`.
///
/// q and k are `[batch, seq, heads, head_dim]` (k may have fewer heads: GQA); transposed
/// `[batch, heads, seq, head_dim]` views pass as `swap_dims(1, 2)` without a copy.
///
/// # Panics
/// On mismatched batch/seq/head_dim, γ not `[head_dim]`, dtypes that differ, or positions past the
/// table.
pub fn rms_norm_rope<B: RmsNormRopeBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    q_gamma: Tensor<B, 1>,
    k_gamma: Tensor<B, 1>,
    table: &RopeTable<B>,
    offset: usize,
    epsilon: f64,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    const OP: &str = "rms_norm_rope";
    let (q, k, qg, kg) = (prim(q), prim(k), prim(q_gamma), prim(k_gamma));
    validate_heads::<B>(OP, &q, table, offset);
    validate_heads::<B>(OP, &k, table, offset);
    let (qs, ks) = (q.shape(), k.shape());
    ensure(qs[0] == ks[0] && qs[1] == ks[1], OP, || {
        format!("q {:?} and k {:?} must share batch and seq", qs.as_slice(), ks.as_slice())
    });
    for (name, g) in [("q_gamma", &qg), ("k_gamma", &kg)] {
        ensure(g.shape().as_slice() == [qs[3]], OP, || {
            format!("{name} has shape {:?}; expected [{}] (head_dim)", g.shape().as_slice(), qs[3])
        });
    }
    ensure_same_dtype(OP, &[("q", q.dtype()), ("k", k.dtype()), ("q_gamma", qg.dtype()), ("k_gamma", kg.dtype())]);
    let out = B::rms_norm_rope_forward(q, k, qg, kg, prim(table.cos()), prim(table.sin()), offset, epsilon);
    (wrap(out.q), wrap(out.k))
}
