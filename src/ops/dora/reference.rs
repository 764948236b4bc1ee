//! DoRA's rescaling and factored weight norm from plain Burn tensor ops: the oracle of the tests
//! and the implementation on backends without kernels. Arithmetic in f32 (f64 for f64 inputs),
//! like the kernels.

use burn::tensor::{FloatDType, Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

use crate::ops::{compute_dtype, prim, prim_as, wrap};

/// `u` as `[rows, out]` in the compute dtype.
fn rows<B: Backend>(u: FloatTensor<B>) -> Tensor<B, 2> {
    let shape = u.shape();
    let width = shape[shape.num_dims() - 1];
    let dtype = compute_dtype(u.dtype());
    wrap::<B, 1>(B::float_reshape(u, [shape.num_elements()].into())).reshape([shape.num_elements() / width.max(1), width]).cast(dtype)
}

/// A `[out]` column input as `[1, out]` in `dtype`.
fn column<B: Backend>(t: FloatTensor<B>, dtype: FloatDType) -> Tensor<B, 2> {
    wrap::<B, 1>(t).cast(dtype).unsqueeze_dim(0)
}

/// `(c, b)` as `[1, out]` rows: `c = m / norm`, `b` the bias or zero.
fn scale_and_bias<B: Backend>(
    magnitude: FloatTensor<B>,
    norm: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    dtype: FloatDType,
) -> (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>) {
    let norm = column::<B>(norm, dtype);
    let c = column::<B>(magnitude, dtype) / norm.clone();
    let b = match bias {
        Some(b) => column::<B>(b, dtype),
        None => c.zeros_like(),
    };
    (c, b, norm)
}

pub fn forward<B: Backend>(
    u: FloatTensor<B>,
    magnitude: FloatTensor<B>,
    norm: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let (shape, dtype) = (u.shape(), u.dtype());
    let u = rows::<B>(u);
    let (c, b, _) = scale_and_bias::<B>(magnitude, norm, bias, compute_dtype(dtype));
    prim_as((c * (u - b.clone()) + b).cast(dtype), shape)
}

pub fn backward<B: Backend>(
    u: FloatTensor<B>,
    magnitude: FloatTensor<B>,
    norm: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    dy: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (shape, dtype, m_dtype) = (u.shape(), u.dtype(), magnitude.dtype());
    let (u, dy) = (rows::<B>(u), rows::<B>(dy));
    let (c, b, norm) = scale_and_bias::<B>(magnitude, norm, bias, compute_dtype(dtype));
    let dm = ((dy.clone() * (u - b)).sum_dim(0) / norm).flatten::<1>(0, 1);
    (prim_as((dy * c).cast(dtype), shape), prim(dm.cast(m_dtype)))
}

/// `‖W + s · B · A‖` per output row in factored form (see the module's documentation), in the
/// compute dtype.
pub fn norm<B: Backend>(
    weight_norms_sq: FloatTensor<B>,
    a_w: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    scale: f64,
) -> FloatTensor<B> {
    let dtype = compute_dtype(a.dtype());
    let [a, b, a_w] = [a, b, a_w].map(|t| wrap::<B, 2>(t).cast(dtype));
    let w_sq = wrap::<B, 1>(weight_norms_sq).cast(dtype).unsqueeze_dim::<2>(1);
    let cross = (b.clone() * a_w.transpose()).sum_dim(1);
    let gram = a.clone().matmul(a.transpose());
    let quadratic = (b.clone().matmul(gram) * b).sum_dim(1);
    let squared = w_sq + cross * (2.0 * scale) + quadratic * (scale * scale);
    prim(squared.clamp_min(0.0).sqrt().squeeze_dim::<1>(1))
}
