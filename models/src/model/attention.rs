//! Self-attention of one decoder layer: projections, QK-norm + RoPE (one fused kernel) or RoPE,
//! the KV cache, and kiln's flash attention (GQA without repeating K/V, causal, sliding window).

use burn::module::Module;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, backend::Backend, s};
use kiln::KilnBackend;
use kiln::nn::RmsNorm;
use kiln::ops::{AttentionOptions, RopeTable, flash_attention, rms_norm_rope, rope};

use super::projection::Projection;

#[derive(Module, Debug)]
pub struct Attention<B: Backend, L: Module<B>> {
    pub q_proj: L,
    pub k_proj: L,
    pub v_proj: L,
    pub o_proj: L,
    /// Qwen3's per-head RMSNorm on q and k.
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    /// BitNet's RMSNorm on the attention output, before `o_proj` quantizes it.
    pub sub_norm: Option<RmsNorm<B>>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    #[module(skip)]
    pub window: Option<usize>,
}

/// `norm(x)` where the model has the norm (BitNet's sub-norms), else `x`.
pub(super) fn sub_norm<B: KilnBackend>(norm: &Option<RmsNorm<B>>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    match norm {
        Some(norm) => norm.forward(x),
        None => x,
    }
}

/// Keys and values of one layer in preallocated `[batch, kv_heads, capacity, head_dim]` buffers.
/// Appending writes only the new positions: the buffer is taken out of the cache first, so Burn
/// sees a single owner and updates it in place.
#[derive(Debug, Clone)]
pub struct LayerCache<B: Backend> {
    k: Option<Tensor<B, 4>>,
    v: Option<Tensor<B, 4>>,
}

impl<B: Backend> LayerCache<B> {
    pub fn new(shape: [usize; 4], dtype: burn::tensor::DType, device: &B::Device) -> Self {
        let buffer = || Some(Tensor::zeros(shape, (device, dtype)));
        Self { k: buffer(), v: buffer() }
    }

    /// The key and value buffers.
    pub(super) fn buffers(&self) -> impl Iterator<Item = &Tensor<B, 4>> {
        self.k.iter().chain(self.v.iter())
    }

    /// Writes one position's `k`, `v` (`[batch, kv_heads, 1, head_dim]`) at `position` and returns
    /// the whole buffers. Every shape here is the same at each step (the position travels as an
    /// index tensor), so Burn's fusion and CubeCL reuse one plan and one set of kernels for all
    /// steps instead of compiling for each new length. The buffers hold zeros where nothing was
    /// written yet, so adding writes the value.
    fn write_step(&mut self, position: Tensor<B, 1, Int>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let write = |slot: &mut Option<Tensor<B, 4>>, new: Tensor<B, 4>| {
            let buffer = slot.take().expect("a cache buffer is always present between calls");
            let buffer = buffer.select_assign(2, position.clone(), new, IndexingUpdateOp::Add);
            *slot = Some(buffer.clone());
            buffer
        };
        (write(&mut self.k, k), write(&mut self.v, v))
    }

    /// Writes `k`, `v` at positions `start..` and returns the keys and values of `0..end`.
    fn append(&mut self, start: usize, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let end = start + k.dims()[2];
        let write = |slot: &mut Option<Tensor<B, 4>>, new: Tensor<B, 4>| {
            let buffer = slot.take().expect("a cache buffer is always present between calls");
            let buffer = buffer.slice_assign(s![.., .., start..end, ..], new);
            *slot = Some(buffer.clone());
            buffer.slice(s![.., .., 0..end, ..])
        };
        (write(&mut self.k, k), write(&mut self.v, v))
    }
}

/// What every layer's attention needs for one forward call besides its input.
pub struct Step<'a, B: Backend> {
    /// The model's table; a decode step passes the rows of its position only (offset 0).
    pub rope: &'a RopeTable<B>,
    /// Row of `rope` of the first input token (the cache's length before a prefill).
    pub offset: usize,
    pub mode: StepMode<B>,
}

/// How attention finds its keys and masks them.
pub enum StepMode<B: Backend> {
    /// Keys are this call's (and the cache's up to here), masked causally and by each layer's
    /// window; `padding` (`[batch, 1, q_len, kv_len]`, additive) hides left padding.
    Causal { padding: Option<Tensor<B, 4>> },
    /// One token per sequence over the whole cache buffer: `position` (`[1]`) says where its
    /// key/value go, and each layer takes the additive mask (`[batch, 1, 1, capacity]`) built for
    /// its window, which hides unwritten positions, padding and keys out of the window.
    Decode { position: Tensor<B, 1, Int>, masks: Vec<(Option<usize>, Tensor<B, 4>)> },
}

impl<B: KilnBackend, L: Projection<B>> Attention<B, L> {
    pub fn forward(&self, x: Tensor<B, 3>, step: &Step<'_, B>, cache: Option<&mut LayerCache<B>>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let heads = |t: Tensor<B, 3>, n: usize| t.reshape([batch, seq, n, self.head_dim]);
        let q = heads(self.q_proj.forward(x.clone()), self.num_heads);
        let k = heads(self.k_proj.forward(x.clone()), self.num_kv_heads);
        let v = heads(self.v_proj.forward(x), self.num_kv_heads).swap_dims(1, 2);
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => rms_norm_rope(q, k, qn.weight.val(), kn.weight.val(), step.rope, step.offset, qn.epsilon),
            _ => (rope(q, step.rope, step.offset), rope(k, step.rope, step.offset)),
        };
        let (q, k) = (q.swap_dims(1, 2), k.swap_dims(1, 2));
        let (k, v, mask, options) = match (&step.mode, cache) {
            (StepMode::Decode { position, masks }, Some(cache)) => {
                let (k, v) = cache.write_step(position.clone(), k, v);
                let mask = masks.iter().find(|(w, _)| *w == self.window).map(|(_, m)| m.clone());
                (k, v, mask, AttentionOptions::default())
            }
            (mode, cache) => {
                let (k, v) = match cache {
                    Some(cache) => cache.append(step.offset, k, v),
                    None => (k, v),
                };
                let padding = match mode {
                    StepMode::Causal { padding } => padding.clone(),
                    StepMode::Decode { .. } => None,
                };
                (k, v, padding, AttentionOptions { causal: true, window: self.window, ..AttentionOptions::default() })
            }
        };
        let out = flash_attention(q, k, v, mask, options).swap_dims(1, 2).reshape([batch, seq, self.num_heads * self.head_dim]);
        self.o_proj.forward(sub_norm(&self.sub_norm, out))
    }
}
