//! Greedy decode steps replayed from a CUDA graph on Burn's `Cuda` backend (issue 22). Through
//! Burn, each of a step's ~400 kernels costs host time (RESULTS: ~5 ms a token for a 0.5B model);
//! [`Decoder::decode_hidden`] keeps every kernel and argument of a step the same at each position,
//! so one step is captured ([`kiln::backend::graph`]) and each later step is one graph launch:
//! the host writes the step's tokens and position, launches, and reads the next tokens back.
//!
//! Captured once the fusion plans and kernels are warm (a few plain steps after the prefill). The
//! KV cache must be written in place, which the capture checks by comparing the cache's buffer
//! addresses before and after it.

use std::any::{Any, TypeId};

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorKind, backend::Backend};
use kiln::KilnBackend;
use kiln::backend::graph::{CudaGraph, DeviceBuffer, GraphNodes, float_buffer, int_buffer};

use super::sampler::{self, SamplingConfig};
use crate::model::{DecodeInputs, Decoder, DecoderCache, Projection};

/// Layers a captured part holds: a float layer's step uploads ~6 buffers of CubeCL metadata, so
/// 4 layers stay well under the capture's limit (`kiln::backend::graph::MAX_UPLOADS_PER_PART`).
const LAYERS_PER_PART: usize = 4;

/// One decode step as a replayable graph, with the device buffers it reads and writes.
pub(super) struct GraphStep<B: Backend> {
    graph: CudaGraph,
    tokens: DeviceBuffer,
    position: DeviceBuffer,
    next: DeviceBuffer,
    /// The tensors behind those buffers and the step's constant inputs (pads), held while the
    /// graph lives.
    _held: (Tensor<B, 2, Int>, DecodeInputs<B>, Tensor<B, 1, Int>),
}

impl<B: Backend> GraphStep<B> {
    /// Runs the step for `tokens` (one per row) at `position`; returns the next token of each row.
    pub(super) fn run(&mut self, tokens: &[i64], position: usize) -> Result<Vec<i64>, String> {
        let tokens = encode(tokens, self.tokens.dtype)?;
        let position = encode(&[position as i64], self.position.dtype)?;
        let uploads = [(self.tokens.ptr, tokens.as_slice()), (self.position.ptr, position.as_slice())];
        let bytes = self.graph.replay(&uploads, self.next.ptr, self.next.bytes)?;
        decode(&bytes, self.next.dtype)
    }

    pub(super) fn nodes(&self) -> GraphNodes {
        self.graph.nodes()
    }
}

/// Captures the greedy decode step of `model` over `cache` (rows left-padded by `pads`). `None`
/// where the backend is not `Cuda`; an error where the capture failed (nothing was kept).
pub(super) fn capture<B: KilnBackend, L: Projection<B>>(
    model: &Decoder<B, L>,
    cache: &mut DecoderCache<B>,
    pads: &[usize],
    sampling: &SamplingConfig,
) -> Option<Result<GraphStep<B>, String>> {
    if TypeId::of::<B>() != TypeId::of::<Cuda>() {
        return None;
    }
    let device = model.embed_tokens.weight.device();
    let cuda = (&device as &dyn Any).downcast_ref::<CudaDevice>()?.clone();
    Some(capture_on(&cuda, model, cache, pads, sampling))
}

fn capture_on<B: KilnBackend, L: Projection<B>>(
    cuda: &CudaDevice,
    model: &Decoder<B, L>,
    cache: &mut DecoderCache<B>,
    pads: &[usize],
    sampling: &SamplingConfig,
) -> Result<GraphStep<B>, String> {
    let device = model.embed_tokens.weight.device();
    let batch = pads.len();
    let tokens_in = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![0i64; batch], [batch, 1]), &device);
    let inputs = DecodeInputs::new(cache.len(), pads, &device);
    let (tokens, position) = (int_buffer(as_cuda(&tokens_in)?)?, int_buffer(as_cuda(&inputs.position)?)?);
    let before = cache_addresses(cache)?;
    let (graph, next) = CudaGraph::capture(cuda, |split| {
        let mut after_layer = |layer: usize| {
            if (layer + 1) % LAYERS_PER_PART == 0 {
                split();
            }
        };
        let hidden = model.decode_hidden_with(tokens_in.clone(), cache, &inputs, &mut after_layer);
        sampler::sample(model.last_logits(hidden), sampling, None)
    })?;
    if cache_addresses(cache)? != before {
        return Err("the captured step did not write the KV cache in place".into());
    }
    let next_buffer = int_buffer(as_cuda(&next)?)?;
    Ok(GraphStep { graph, tokens, position, next: next_buffer, _held: (tokens_in, inputs, next) })
}

/// Device addresses of every layer's key and value buffers.
fn cache_addresses<B: Backend>(cache: &DecoderCache<B>) -> Result<Vec<u64>, String> {
    // Each buffer is released at once: a held handle would stop the cache's in-place writes.
    cache.buffers().map(|t| as_cuda(t).and_then(float_buffer).map(|b| b.ptr)).collect()
}

fn as_cuda<B: Backend, const D: usize, K>(tensor: &Tensor<B, D, K>) -> Result<&Tensor<Cuda, D, K>, String>
where
    K: TensorKind<B> + TensorKind<Cuda> + 'static,
{
    (tensor as &dyn Any).downcast_ref().ok_or_else(|| "not a tensor of Burn's `Cuda` backend".to_string())
}

/// Little-endian integers of the device's integer dtype.
fn encode(values: &[i64], dtype: DType) -> Result<Vec<u8>, String> {
    match dtype {
        DType::I32 => Ok(values.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect()),
        DType::I64 => Ok(values.iter().flat_map(|&v| v.to_le_bytes()).collect()),
        other => Err(format!("integer tensors of dtype {other:?} are not supported by the graph step")),
    }
}

fn decode(bytes: &[u8], dtype: DType) -> Result<Vec<i64>, String> {
    match dtype {
        DType::I32 => Ok(bytes.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64).collect()),
        DType::I64 => Ok(bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()),
        other => Err(format!("integer tensors of dtype {other:?} are not supported by the graph step")),
    }
}
