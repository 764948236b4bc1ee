//! Attention from plain Burn tensor ops, materializing the scores: the test oracle (in f64) and
//! the fallback on backends without kernels. Computes in f32 (f64 stays f64), like the kernels.

use burn::tensor::{Bool, Int, Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::{AttentionOptions, AttentionOutput, EMPTY_LSE};
use crate::ops::{compute_dtype, prim, wrap};

/// Logit of a masked key: below every real logit, finite so no NaN arises.
const MASKED: f64 = -1.0e30;

fn compute<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 4> {
    let dtype = compute_dtype(t.dtype());
    wrap::<B, 4>(t).cast(dtype)
}

/// `[batch, kv_heads, s, d]` → `[batch, kv_heads · group, s, d]`, each kv head repeated `group`
/// times in a row.
fn repeat_kv<B: Backend>(x: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    let [b, h, s, d] = x.dims();
    x.reshape([b, h, 1, s, d]).expand([b, h, group, s, d]).reshape([b, h * group, s, d])
}

/// Sum the `group` query heads that share each kv head: the inverse of [`repeat_kv`] for gradients.
fn sum_groups<B: Backend>(x: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    let [b, h, s, d] = x.dims();
    x.reshape([b, h / group, group, s, d]).sum_dim(2).reshape([b, h / group, s, d])
}

/// `[1, 1, q_len, kv_len]` visibility of key `j` to query `i` under the options' masks.
fn visibility<B: Backend>(q_len: usize, kv_len: usize, options: &AttentionOptions, device: &B::Device) -> Tensor<B, 4, Bool> {
    let rows = Tensor::<B, 1, Int>::arange(0..q_len as i64, device).reshape([q_len, 1]).expand([q_len, kv_len]);
    let cols = Tensor::<B, 1, Int>::arange(0..kv_len as i64, device).reshape([1, kv_len]).expand([q_len, kv_len]);
    let (q_len, kv_len) = (q_len as i64, kv_len as i64);
    let mut visible = Tensor::<B, 2, Bool>::full([q_len as usize, kv_len as usize], true, device);
    if options.causal {
        // j ≤ i + kv_len − q_len
        visible = visible.bool_and(cols.clone().add_scalar(q_len).lower_equal(rows.clone().add_scalar(kv_len)));
    }
    if let Some(window) = options.window {
        // i + kv_len − q_len − j < window
        visible = visible.bool_and(rows.add_scalar(kv_len).lower(cols.add_scalar(q_len + window as i64)));
    }
    visible.unsqueeze::<4>()
}

/// Everything both passes recompute: the capped logits (before bias), the masked logits and the
/// visibility as 0/1.
struct Logits<B: Backend> {
    capped: Tensor<B, 4>,
    masked: Tensor<B, 4>,
    visible: Tensor<B, 4>,
}

fn logits<B: Backend>(q: &Tensor<B, 4>, k: &Tensor<B, 4>, bias: Option<FloatTensor<B>>, options: &AttentionOptions) -> Logits<B> {
    let [_, _, q_len, head_dim] = q.dims();
    let kv_len = k.dims()[2];
    let scores = q.clone().matmul(k.clone().swap_dims(2, 3)).mul_scalar(options.scale_for(head_dim));
    let capped = match options.softcap {
        Some(c) => scores.div_scalar(c).tanh().mul_scalar(c),
        None => scores,
    };
    let biased = match bias {
        Some(bias) => capped.clone() + wrap::<B, 4>(bias).cast(q.dtype()),
        None => capped.clone(),
    };
    let visible_mask = visibility::<B>(q_len, kv_len, options, &q.device());
    let masked = biased.mask_fill(visible_mask.clone().bool_not().expand(capped.dims()), MASKED);
    let visible = Tensor::<B, 4>::ones([1, 1, q_len, kv_len], (&q.device(), q.dtype())).mask_fill(visible_mask.bool_not(), 0.0);
    Logits { capped, masked, visible }
}

/// The forward: output in the input dtype, log-sum-exp f32 (f64 for f64 inputs).
pub fn forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: AttentionOptions,
) -> AttentionOutput<B> {
    let dtype = q.dtype();
    let group = q.shape()[1] / k.shape()[1];
    let (q, k, v) = (compute::<B>(q), repeat_kv(compute::<B>(k), group), repeat_kv(compute::<B>(v), group));
    let l = logits(&q, &k, bias, &options);
    // Softmax is shift invariant: the row maximum is a constant for the gradient.
    let max = l.masked.clone().max_dim(3).detach();
    let p = (l.masked - max.clone()).exp() * l.visible;
    let sum = p.clone().sum_dim(3);
    let empty = sum.clone().equal_elem(0.0);
    // The smallest normal f32 (f64::MIN_POSITIVE would round to 0 in f32 and give 0/0 on empty rows).
    let tiny = f32::MIN_POSITIVE as f64;
    let output = p.matmul(v) / sum.clone().clamp_min(tiny);
    let lse = (max + sum.clamp_min(tiny).log()).mask_fill(empty, EMPTY_LSE as f64);
    let [b, h, s, _] = lse.dims();
    AttentionOutput { output: prim(output.cast(dtype)), lse: prim(lse.reshape([b, h, s])) }
}

/// The backward from the saved log-sum-exp: `P = exp(logit − lse)`, `dV = Pᵀ dO`,
/// `dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))` (times the softcap's derivative), `dQ = dS K · scale`,
/// `dK = dSᵀ Q · scale`, with GQA gradients summed over each group.
#[allow(clippy::too_many_arguments)]
pub fn backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    output: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_output: FloatTensor<B>,
    options: AttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let dtype = q.dtype();
    let head_dim = q.shape()[3];
    let group = q.shape()[1] / k.shape()[1];
    let (q, k, v) = (compute::<B>(q), repeat_kv(compute::<B>(k), group), repeat_kv(compute::<B>(v), group));
    let (output, d_output) = (compute::<B>(output), compute::<B>(d_output));
    let lse = wrap::<B, 3>(lse).cast(q.dtype()).unsqueeze_dim::<4>(3);
    let l = logits(&q, &k, bias, &options);
    let p = (l.masked - lse).exp() * l.visible;
    let dv = p.clone().swap_dims(2, 3).matmul(d_output.clone());
    let dp = d_output.clone().matmul(v.swap_dims(2, 3));
    let delta = (d_output * output).sum_dim(3);
    let mut ds = p * (dp - delta);
    if let Some(c) = options.softcap {
        let t = l.capped.div_scalar(c);
        ds = ds * (t.clone() * t).neg().add_scalar(1.0);
    }
    let scale = options.scale_for(head_dim);
    let dq = ds.clone().matmul(k).mul_scalar(scale);
    let dk = ds.swap_dims(2, 3).matmul(q).mul_scalar(scale);
    let grads = [dq, sum_groups(dk, group), sum_groups(dv, group)];
    let [dq, dk, dv] = grads.map(|g| prim(g.cast(dtype)));
    (dq, dk, dv)
}
