//! Cross-entropy of logits against integer targets, per row in f32: the language-model loss
//! without the logits-sized f32 copies that composed ops make (a cast, a log-softmax kept for the
//! backward, its gradient), one read of the logits forward and one read and one write backward.

mod backward;
mod cube;
mod fusion;
pub mod reference;

use burn::tensor::{Int, Tensor, TensorMetadata, backend::Backend, ops::{FloatTensor, IntTensor}};

use super::{prim, wrap};
use crate::error::{ensure, ensure_float};

/// Backend support for the fused cross-entropy. The default methods are the reference.
pub trait CrossEntropyBackend: Backend {
    /// `(loss, lse)` of `logits [rows, width]` against `targets [rows]`: per row
    /// `lse = log Σ exp(logits)` and `loss = lse − logits[target]` (0 where the target is
    /// negative, NaN where it is `width` or more), both `[rows]` in f32 (f64 for f64 logits).
    fn cross_entropy_forward(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::forward::<Self>(logits, targets)
    }

    /// The logits' gradient `dloss · (softmax(logits) − onehot(target))` per row (0 for negative
    /// targets), in the logits' dtype, from the forward's inputs, its `lse` and the loss gradient
    /// `dloss [rows]`.
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::backward::<Self>(logits, targets, lse, dloss)
    }
}

crate::backend::reference_backends!(CrossEntropyBackend);

/// Cross-entropy of each row of `logits [rows, vocab]` against its target class: `[rows]` losses
/// in f32 (f64 for f64 logits) whatever the logits' dtype, as PyTorch's `cross_entropy` with
/// `reduction="none"`. A negative target (PyTorch's `ignore_index` −100) leaves its row out:
/// loss 0, no gradient. A target of `vocab` or more gives NaN, loss and gradient, where PyTorch
/// stops with a device assert. The mean over counted rows is the usual training loss:
///
/// ```ignore
/// let losses = kiln::ops::cross_entropy(logits, targets.clone());
/// let counted = targets.greater_equal_elem(0).float().sum().clamp_min(1.0);
/// let loss = losses.sum() / counted;
/// ```
///
/// # Panics
/// If `logits` is not a float tensor with a nonzero last axis, or `targets` is not `[rows]`.
pub fn cross_entropy<B: CrossEntropyBackend>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let (logits, targets) = (prim(logits), targets.into_primitive());
    validate::<B>(&logits, &targets);
    wrap(B::cross_entropy_forward(logits, targets).0)
}

fn validate<B: Backend>(logits: &FloatTensor<B>, targets: &IntTensor<B>) {
    const OP: &str = "cross_entropy";
    let (shape, target_shape) = (logits.shape(), targets.shape());
    ensure_float(OP, "logits", logits.dtype());
    ensure(shape[1] > 0 && shape[1] <= i32::MAX as usize, OP, || format!("logits {:?} need 1 to 2^31 − 1 classes", shape.as_slice()));
    ensure(target_shape[0] == shape[0], OP, || {
        format!("targets {:?} must hold one class per row of logits {:?}", target_shape.as_slice(), shape.as_slice())
    });
}
