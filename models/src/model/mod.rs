//! The decoder: one module for every family, generic over its linear layers (see
//! [`projection`]), built from any [`ParamSource`](crate::loader::ParamSource).

mod attention;
pub mod bitnet;
pub mod build;
mod mask;
pub mod nf4;
pub mod projection;

use burn::module::Module;
use burn::nn::Embedding;
use burn::tensor::{DType, Int, Tensor, backend::Backend, s};
use kiln::KilnBackend;
use kiln::nn::{Linear, RmsNorm};
use kiln::ops::{RopeTable, glu, swiglu::GluActivation};

pub use attention::{Attention, LayerCache, Step, StepMode};
pub use mask::DecodeInputs;
pub use projection::Projection;

use crate::config::DecoderConfig;

/// A decoder with kiln's float [`Linear`] layers.
pub type FloatDecoder<B> = Decoder<B, Linear<B>>;

/// Pre-norm block: `h = x + attn(norm₁(x)); y = h + mlp(norm₂(h))`, each residual add fused into
/// the RMSNorm that follows it. The MLP is `down(sub_norm(act(gate(x)) · up(x)))`, the sub-norm
/// being BitNet's (absent elsewhere).
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend, L: Module<B>> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B, L>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub gate_proj: L,
    pub up_proj: L,
    /// BitNet's RMSNorm on the gated product, before `down_proj` quantizes it.
    pub ffn_sub_norm: Option<RmsNorm<B>>,
    pub down_proj: L,
    #[module(skip)]
    pub activation: GluActivation,
}

#[derive(Module, Debug)]
pub struct Decoder<B: Backend, L: Module<B>> {
    pub embed_tokens: Embedding<B>,
    pub layers: Vec<DecoderLayer<B, L>>,
    pub norm: RmsNorm<B>,
    /// The output head; `None` when tied to the embedding.
    pub lm_head: Option<Linear<B>>,
    pub rope: RopeTable<B>,
    #[module(skip)]
    pub config: DecoderConfig,
}

/// The KV caches of all layers and the number of positions they hold.
#[derive(Debug, Clone)]
pub struct DecoderCache<B: Backend> {
    layers: Vec<LayerCache<B>>,
    len: usize,
    capacity: usize,
    /// `[1, capacity]`: `0..capacity`, the key positions decode masks compare against.
    keys: Tensor<B, 2, Int>,
}

impl<B: Backend> DecoderCache<B> {
    /// Positions stored (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Every layer's key and value buffers (`[batch, kv_heads, capacity, head_dim]`).
    pub fn buffers(&self) -> impl Iterator<Item = &Tensor<B, 4>> {
        self.layers.iter().flat_map(LayerCache::buffers)
    }

    /// Counts `n` positions written by steps that do not advance the count themselves
    /// ([`Decoder::decode_hidden`]).
    pub fn advance(&mut self, n: usize) {
        assert!(self.len + n <= self.capacity, "kiln-models: {} positions exceed the cache capacity {}", self.len + n, self.capacity);
        self.len += n;
    }
}

impl<B: Backend, L: Module<B>> Decoder<B, L> {
    /// An empty cache for `batch` sequences of up to `capacity` positions, in the model's dtype.
    ///
    /// # Panics
    /// If `capacity` exceeds the RoPE tables' positions (`config.max_positions`).
    pub fn new_cache(&self, batch: usize, capacity: usize) -> DecoderCache<B> {
        let c = &self.config;
        assert!(
            capacity <= self.rope.max_positions(),
            "kiln-models: cache capacity {capacity} exceeds the model's {} RoPE positions (raise max_positions)",
            self.rope.max_positions()
        );
        let device = self.embed_tokens.weight.device();
        let shape = [batch, c.num_kv_heads, capacity, c.head_dim];
        let layers = (0..c.num_layers).map(|_| LayerCache::new(shape, self.dtype(), &device)).collect();
        let keys = Tensor::arange(0..capacity as i64, &device).reshape([1, capacity]);
        DecoderCache { layers, len: 0, capacity, keys }
    }

    /// The dtype of the activations (the embedding's).
    pub fn dtype(&self) -> DType {
        self.embed_tokens.weight.val().dtype()
    }

    /// Replaces every linear of the attention and MLP blocks with `f(name, layer)`, `name` being
    /// its HF module path (`model.layers.3.self_attn.q_proj`, `model.layers.3.mlp.down_proj`).
    pub fn map_linears<L2: Module<B>>(self, mut f: impl FnMut(&str, L) -> L2) -> Decoder<B, L2> {
        let layers = self
            .layers
            .into_iter()
            .enumerate()
            .map(|(i, layer)| {
                let mut map = |part: &str, l: L| f(&format!("model.layers.{i}.{part}"), l);
                let a = layer.self_attn;
                DecoderLayer {
                    input_layernorm: layer.input_layernorm,
                    self_attn: Attention {
                        q_proj: map("self_attn.q_proj", a.q_proj),
                        k_proj: map("self_attn.k_proj", a.k_proj),
                        v_proj: map("self_attn.v_proj", a.v_proj),
                        o_proj: map("self_attn.o_proj", a.o_proj),
                        q_norm: a.q_norm,
                        k_norm: a.k_norm,
                        sub_norm: a.sub_norm,
                        num_heads: a.num_heads,
                        num_kv_heads: a.num_kv_heads,
                        head_dim: a.head_dim,
                        window: a.window,
                    },
                    post_attention_layernorm: layer.post_attention_layernorm,
                    gate_proj: map("mlp.gate_proj", layer.gate_proj),
                    up_proj: map("mlp.up_proj", layer.up_proj),
                    ffn_sub_norm: layer.ffn_sub_norm,
                    down_proj: map("mlp.down_proj", layer.down_proj),
                    activation: layer.activation,
                }
            })
            .collect();
        Decoder { embed_tokens: self.embed_tokens, layers, norm: self.norm, lm_head: self.lm_head, rope: self.rope, config: self.config }
    }

    /// Every linear of the attention and MLP blocks with its HF module path, in the order
    /// [`Decoder::map_linears`] visits them.
    pub fn linears(&self) -> Vec<(String, &L)> {
        let mut all = Vec::with_capacity(7 * self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let parts = [
                ("self_attn.q_proj", &a.q_proj),
                ("self_attn.k_proj", &a.k_proj),
                ("self_attn.v_proj", &a.v_proj),
                ("self_attn.o_proj", &a.o_proj),
                ("mlp.gate_proj", &layer.gate_proj),
                ("mlp.up_proj", &layer.up_proj),
                ("mlp.down_proj", &layer.down_proj),
            ];
            all.extend(parts.map(|(part, l)| (format!("model.layers.{i}.{part}"), l)));
        }
        all
    }
}

impl<B: KilnBackend, L: Projection<B>> DecoderLayer<B, L> {
    /// `delta` is the previous block's output not yet added to `residual`; returns this block's
    /// MLP output (not yet added) and the residual stream.
    fn forward(&self, delta: Option<Tensor<B, 3>>, residual: Tensor<B, 3>, step: &Step<'_, B>, cache: Option<&mut LayerCache<B>>) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let (normed, residual) = match delta {
            Some(delta) => self.input_layernorm.forward_residual(delta, residual),
            None => (self.input_layernorm.forward(residual.clone()), residual),
        };
        let attended = self.self_attn.forward(normed, step, cache);
        let (normed, residual) = self.post_attention_layernorm.forward_residual(attended, residual);
        let gated = glu(self.gate_proj.forward(normed.clone()), self.up_proj.forward(normed), self.activation);
        (self.down_proj.forward(attention::sub_norm(&self.ffn_sub_norm, gated)), residual)
    }
}

impl<B: KilnBackend, L: Projection<B>> Decoder<B, L> {
    /// Logits `[batch, seq, vocab]` of every position (training, scoring).
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.logits(self.hidden(tokens, None, &[]))
    }

    /// The final normed hidden states `[batch, seq, hidden]`. With a cache, `tokens` follow the
    /// positions it holds and their keys/values are stored; a single token per row is a decode
    /// step ([`Decoder::decode_hidden`]). `pads[row]` (empty: none) counts the left padding of
    /// each row's prompt, which attention never sees.
    ///
    /// # Panics
    /// If the cache cannot hold the new tokens, or `pads` is not empty and not one per row.
    pub fn hidden(&self, tokens: Tensor<B, 2, Int>, cache: Option<&mut DecoderCache<B>>, pads: &[usize]) -> Tensor<B, 3> {
        let [batch, seq] = tokens.dims();
        assert!(pads.is_empty() || pads.len() == batch, "kiln-models: {} pads for {batch} rows", pads.len());
        let device = tokens.device();
        let no_pads = vec![0; batch];
        let pads = if pads.is_empty() { &no_pads } else { pads };
        match cache {
            Some(cache) if seq == 1 => {
                let inputs = DecodeInputs::new(cache.len, pads, &device);
                cache.advance(1);
                self.decode_hidden(tokens, cache, &inputs)
            }
            Some(cache) => {
                let offset = cache.len;
                cache.advance(seq);
                let padding = mask::padding(pads, seq, offset + seq, self.dtype(), &device);
                self.run_layers(tokens, &Step { rope: &self.rope, offset, mode: StepMode::Causal { padding } }, Some(cache), &mut |_| {})
            }
            None => {
                let padding = mask::padding(pads, seq, seq, self.dtype(), &device);
                self.run_layers(tokens, &Step { rope: &self.rope, offset: 0, mode: StepMode::Causal { padding } }, None, &mut |_| {})
            }
        }
    }

    /// One decode step driven by device inputs: each row's token (`[batch, 1]`) goes to
    /// `inputs.position`, attends over the whole cache buffer under masks built on the device, and
    /// its keys/values are written into the cache; returns the final normed hidden states
    /// `[batch, 1, hidden]`. Every shape, kernel and kernel argument is the same at each step, so
    /// Burn's fusion reuses one plan and a CUDA graph can replay the step. The cache's count is not
    /// advanced: the caller owns it ([`DecoderCache::advance`]).
    pub fn decode_hidden(&self, tokens: Tensor<B, 2, Int>, cache: &mut DecoderCache<B>, inputs: &DecodeInputs<B>) -> Tensor<B, 3> {
        self.decode_hidden_with(tokens, cache, inputs, &mut |_| {})
    }

    /// [`Decoder::decode_hidden`], calling `after_layer(i)` once layer `i`'s ops are enqueued (a
    /// CUDA graph capture splits the step there).
    pub fn decode_hidden_with(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut DecoderCache<B>,
        inputs: &DecodeInputs<B>,
        after_layer: &mut dyn FnMut(usize),
    ) -> Tensor<B, 3> {
        let windows: Vec<Option<usize>> = self.layers.iter().map(|l| l.self_attn.window).collect();
        let masks = inputs.masks(&cache.keys, &windows, self.dtype());
        let rope = self.rope.rows(inputs.position.clone());
        let step = Step { rope: &rope, offset: 0, mode: StepMode::Decode { position: inputs.position.clone(), masks } };
        self.run_layers(tokens, &step, Some(cache), after_layer)
    }

    /// Embedding, every layer and the final norm, over `cache`'s layers when given.
    fn run_layers(
        &self,
        tokens: Tensor<B, 2, Int>,
        step: &Step<'_, B>,
        mut cache: Option<&mut DecoderCache<B>>,
        after_layer: &mut dyn FnMut(usize),
    ) -> Tensor<B, 3> {
        let mut residual = self.embed_tokens.forward(tokens);
        let mut delta = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let layer_cache = cache.as_mut().map(|c| &mut c.layers[i]);
            let (d, r) = layer.forward(delta, residual, step, layer_cache);
            delta = Some(d);
            residual = r;
            after_layer(i);
        }
        match delta {
            Some(delta) => self.norm.forward_residual(delta, residual).0,
            None => self.norm.forward(residual),
        }
    }

    /// Logits of hidden states through the output head.
    pub fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => kiln::ops::linear(hidden, self.head_weight(), None),
        }
    }

    /// The output head's weight `[hidden, vocab]` (Burn's `[in, out]`): the embedding, transposed,
    /// when tied.
    pub fn head_weight(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(head) => head.weight.val(),
            None => self.embed_tokens.weight.val().transpose(),
        }
    }

    /// Logits `[batch, vocab]` of the last position only (what generation needs).
    pub fn last_logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 2> {
        let [batch, seq, width] = hidden.dims();
        let last = hidden.slice(s![.., seq - 1..seq, ..]).reshape([batch, 1, width]);
        self.logits(last).reshape([batch, self.config.vocab_size])
    }
}
