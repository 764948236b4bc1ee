//! The unfused composition: per-head RMSNorm (reference) then RoPE (reference).

use burn::tensor::{TensorMetadata, backend::Backend, ops::FloatTensor};

use super::RmsNormRopeOutput;
use crate::ops::{rms_norm, rope};

/// Per-head RMSNorm then rotation, returning the output and the f32 rstd.
fn norm_rotate<B: Backend>(x: FloatTensor<B>, gamma: FloatTensor<B>, cos: FloatTensor<B>, sin: FloatTensor<B>, offset: usize, epsilon: f64) -> (FloatTensor<B>, FloatTensor<B>) {
    let norm = rms_norm::reference::forward::<B>(x, gamma, None, epsilon);
    (rope::reference::rotate::<B>(norm.output, cos, sin, offset, false), norm.rstd)
}

#[allow(clippy::too_many_arguments)]
pub fn forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    q_gamma: FloatTensor<B>,
    k_gamma: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    offset: usize,
    epsilon: f64,
) -> RmsNormRopeOutput<B> {
    let (q, q_rstd) = norm_rotate::<B>(q, q_gamma, cos.clone(), sin.clone(), offset, epsilon);
    let (k, k_rstd) = norm_rotate::<B>(k, k_gamma, cos, sin, offset, epsilon);
    RmsNormRopeOutput { q, k, q_rstd, k_rstd }
}

pub fn backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    rstd: FloatTensor<B>,
    dy: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    offset: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let dy = B::float_reshape(dy, shape);
    let d_norm = rope::reference::rotate::<B>(dy, cos, sin, offset, true);
    rms_norm::reference::backward::<B>(x, gamma, rstd, d_norm)
}
