//! Fused RMSNorm, optionally with the residual add that precedes it in every pre-norm block:
//! `h = x + residual; y = rms_norm(h) · γ` in one pass that also writes `h`.

mod backward;
mod cube;
mod fusion;
pub mod reference;

use burn::tensor::{Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::{prim, wrap};
use crate::error::{ensure, ensure_float, ensure_same_dtype};

/// Result of the RMSNorm forward on primitives.
#[derive(Debug, Clone)]
pub struct RmsNormOutput<B: Backend> {
    /// `rms_norm(h) · γ`, in the dtype of `x`.
    pub output: FloatTensor<B>,
    /// `h = x + residual` when a residual was given.
    pub residual: Option<FloatTensor<B>>,
    /// `1 / sqrt(mean(h²) + eps)` per row, f32 `[rows]`; saved for the backward.
    pub rstd: FloatTensor<B>,
}

/// Backend support for fused RMSNorm. The default methods are the reference implementation.
pub trait RmsNormBackend: Backend {
    /// `x: [.., width]`, `gamma: [width]`, `residual` shaped like `x`.
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> RmsNormOutput<Self> {
        reference::forward::<Self>(x, gamma, residual, epsilon)
    }

    /// Gradients `(dh, dγ)` from the normalized input `h`, `γ`, the saved `rstd` and `dy`.
    fn rms_norm_backward(
        h: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Self>(h, gamma, rstd, dy)
    }
}

crate::backend::reference_backends!(RmsNormBackend);

/// `x / sqrt(mean(x², last axis) + eps) · γ`, statistics in f32, result in the dtype of `x`.
///
/// # Panics
/// If `gamma` is not `[x.dims()[D-1]]` or the dtypes differ.
pub fn rms_norm<B: RmsNormBackend, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    epsilon: f64,
) -> Tensor<B, D> {
    let (x, gamma) = (prim(x), prim(gamma));
    validate::<B>("rms_norm", &x, &gamma, None);
    wrap(B::rms_norm_forward(x, gamma, None, epsilon).output)
}

/// `h = x + residual; (rms_norm(h) · γ, h)` in one pass: the pre-norm block's residual stream
/// update and the next norm, fused.
///
/// # Panics
/// If `residual` is not shaped like `x`, `gamma` is not `[x.dims()[D-1]]`, or dtypes differ.
pub fn rms_norm_residual<B: RmsNormBackend, const D: usize>(
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    epsilon: f64,
) -> (Tensor<B, D>, Tensor<B, D>) {
    let (x, residual, gamma) = (prim(x), prim(residual), prim(gamma));
    validate::<B>("rms_norm_residual", &x, &gamma, Some(&residual));
    let out = B::rms_norm_forward(x, gamma, Some(residual), epsilon);
    let h = out.residual.expect("a residual forward returns the updated residual");
    (wrap(out.output), wrap(h))
}

/// `x` float, `gamma` `[x.last]` and a residual shaped like `x`, all in one dtype; panics naming
/// `op` otherwise. The ternary ops with an input norm check their `γ` here too.
pub(crate) fn validate<B: Backend>(op: &str, x: &FloatTensor<B>, gamma: &FloatTensor<B>, residual: Option<&FloatTensor<B>>) {
    let (xs, gs) = (x.shape(), gamma.shape());
    ensure_float(op, "x", x.dtype());
    ensure(xs.num_dims() >= 1 && gs.num_dims() == 1 && gs[0] == xs[xs.num_dims() - 1], op, || {
        format!("gamma has shape {:?}; expected [{}] (the last axis of x {:?})", gs.as_slice(), xs.as_slice().last().copied().unwrap_or(0), xs.as_slice())
    });
    let mut dtypes = vec![("x", x.dtype()), ("gamma", gamma.dtype())];
    if let Some(r) = residual {
        ensure(r.shape() == xs, op, || {
            format!("residual has shape {:?}; expected the shape of x {:?}", r.shape().as_slice(), xs.as_slice())
        });
        dtypes.push(("residual", r.dtype()));
    }
    ensure_same_dtype(op, &dtypes);
}
