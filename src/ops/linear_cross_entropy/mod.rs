//! The language-model loss taken straight from the final hidden states: the output head's product
//! and the cross-entropy, chunked over rows so that the `[rows, vocab]` logits and their gradient
//! never exist whole (Liger-Kernel's fused linear cross-entropy). At a 128k vocabulary the logits
//! of 8192 tokens are 2.1 GB in bf16 and their gradient as much again; a chunk holds a few hundred
//! MB of both and frees them before the next.
//!
//! The gradients are taken in the forward, chunk by chunk, while the chunk's logits are at hand:
//! `dlogits = g · (softmax − onehot)` with `g` the reduction's weight (`1 / counted rows` for the
//! mean), then `dhidden = dlogits · Wᵀ` and `dW += hiddenᵀ · dlogits`. The autodiff backward only
//! scales them by the loss gradient. That is why the loss is a scalar: per-row loss gradients are
//! unknown until the backward, and `dW` sums over every row. Without a gradient to take (no
//! autodiff, or inputs that need none) only the losses are computed.
//!
//! Every step is an op kiln already has (`MatmulBackend::gemm`, the cross-entropy kernels), so one
//! generic chunk loop (`chunks.rs`) serves every backend; the reference composes plain Burn ops.

mod backward;
mod chunks;
pub mod reference;

use burn::tensor::{Int, Tensor, TensorMetadata, backend::Backend, ops::{FloatTensor, IntTensor}};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend};

use super::cross_entropy::CrossEntropyBackend;
use super::matmul::MatmulBackend;
use super::{prim, wrap};
use crate::error::{ensure, ensure_float, ensure_same_dtype};

/// How the per-row losses become the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// The mean over the counted rows (targets ≥ 0), PyTorch's default with `ignore_index`; 0 when
    /// no row is counted (PyTorch gives NaN).
    #[default]
    Mean,
    /// The sum over the counted rows.
    Sum,
}

/// Options of [`linear_cross_entropy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinearCrossEntropyOptions {
    pub reduction: Reduction,
    /// Rows a chunk; `None` picks [`default_chunk_rows`].
    pub chunk_rows: Option<usize>,
}

/// Bytes of logits a chunk holds by default. Its gradient takes as much again while the chunk is
/// processed.
pub const CHUNK_BYTES: usize = 256 << 20;

/// Rows a chunk holds at least by default when the weight is trained: every chunk past the first
/// reads and writes the whole `dW` once more (its product adds into it), so a chunk must be long
/// enough for its three head-sized products to dwarf that pass.
pub const TRAINED_CHUNK_ROWS: usize = 2048;

/// Rows a chunk of `vocab` logits of `elem_size` bytes holds under [`CHUNK_BYTES`] (at least
/// [`TRAINED_CHUNK_ROWS`] for a `trained` weight), a multiple of 64 (whole GEMM tiles) when that
/// is more than one, and at most `rows`.
pub fn default_chunk_rows(rows: usize, vocab: usize, elem_size: usize, trained: bool) -> usize {
    let fit = (CHUNK_BYTES / (vocab * elem_size).max(1)).max(1);
    let tiled = if fit >= 64 { fit / 64 * 64 } else { fit };
    let floor = if trained { TRAINED_CHUNK_ROWS } else { 1 };
    tiled.max(floor).min(rows.max(1))
}

/// Backend support for the fused linear cross-entropy. The default method runs the chunk loop on
/// the backend's own products and cross-entropy kernels, without gradients; autodiff overrides it
/// to take them in the forward.
pub trait LinearCrossEntropyBackend: MatmulBackend + CrossEntropyBackend {
    /// The reduced loss `[1]` (f32; f64 for f64 inputs) of `hidden [rows, d] · weight [d, vocab]`
    /// against `targets [rows]`.
    fn linear_cross_entropy(hidden: FloatTensor<Self>, weight: FloatTensor<Self>, targets: IntTensor<Self>, options: LinearCrossEntropyOptions) -> FloatTensor<Self> {
        chunks::run::<Self>(hidden, weight, targets, options, chunks::Wanted::default()).loss
    }
}

crate::backend::reference_backends!(LinearCrossEntropyBackend);

/// CubeCL backends run the default: each chunk's products and cross-entropy are their kernels.
impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> LinearCrossEntropyBackend for CubeBackend<R, F, I, BT> {}

/// Under fusion each product and cross-entropy of a chunk is its own custom op of the stream.
impl<B: FusionBackend + MatmulBackend + CrossEntropyBackend> LinearCrossEntropyBackend for Fusion<B> {}

/// Cross-entropy of `hidden [rows, d] · weight [d, vocab]` (the output head's product, weight in
/// Burn's `[in, out]` layout: a tied embedding `[vocab, d]` enters as its transpose) against
/// `targets [rows]`, reduced to one value `[1]` in f32 (f64 for f64 inputs). Negative targets
/// (PyTorch's −100) are not counted; a target of `vocab` or more makes the loss NaN. Equal to
/// [`super::cross_entropy`] of the product, summed or averaged, without the logits in memory:
///
/// ```ignore
/// let loss = kiln::ops::linear_cross_entropy(hidden, head.transpose(), targets, Default::default());
/// ```
///
/// # Panics
/// If the shapes do not fit as above, or the dtypes differ or are not float.
pub fn linear_cross_entropy<B: LinearCrossEntropyBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    options: LinearCrossEntropyOptions,
) -> Tensor<B, 1> {
    let (hidden, weight, targets) = (prim(hidden), prim(weight), targets.into_primitive());
    validate::<B>(&hidden, &weight, &targets, &options);
    wrap(B::linear_cross_entropy(hidden, weight, targets, options))
}

fn validate<B: Backend>(hidden: &FloatTensor<B>, weight: &FloatTensor<B>, targets: &IntTensor<B>, options: &LinearCrossEntropyOptions) {
    const OP: &str = "linear_cross_entropy";
    let (h, w, t) = (hidden.shape(), weight.shape(), targets.shape());
    let shapes = || format!("hidden {:?}, weight {:?}, targets {:?}", h.as_slice(), w.as_slice(), t.as_slice());
    ensure_float(OP, "hidden", hidden.dtype());
    ensure_same_dtype(OP, &[("hidden", hidden.dtype()), ("weight", weight.dtype())]);
    ensure(h[0] > 0 && h[1] > 0, OP, || format!("hidden must be [rows, d] with rows, d > 0: {}", shapes()));
    ensure(w[0] == h[1], OP, || format!("weight must be [d, vocab] for hidden [rows, d]: {}", shapes()));
    ensure(w[1] > 0 && w[1] <= i32::MAX as usize, OP, || format!("the vocabulary must hold 1 to 2^31 − 1 classes: {}", shapes()));
    ensure(t[0] == h[0], OP, || format!("targets must hold one class per row of hidden: {}", shapes()));
    ensure(options.chunk_rows != Some(0), OP, || "chunk_rows must be at least 1".to_string());
}
