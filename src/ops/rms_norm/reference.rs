//! RMSNorm from plain Burn tensor ops: the oracle of the tests and the implementation on
//! backends without kernels. Statistics in f32, like the kernels.

use burn::tensor::{DType, FloatDType, Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

use crate::ops::{compute_dtype, prim, prim_as, wrap};

use super::RmsNormOutput;

/// Flatten `[.., width]` to `[rows, width]`.
fn rows<B: Backend>(x: FloatTensor<B>) -> (Tensor<B, 2>, usize) {
    let shape = x.shape();
    let width = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / width.max(1);
    (wrap::<B, 1>(B::float_reshape(x, [shape.num_elements()].into())).reshape([rows, width]), rows)
}

/// Promote to the compute dtype (f32, or f64 for the oracle).
fn f32_of<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = compute_dtype(t.dtype());
    t.cast(dtype)
}

fn to<B: Backend, const D: usize>(t: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    t.cast(FloatDType::from(dtype))
}

pub fn forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    residual: Option<FloatTensor<B>>,
    epsilon: f64,
) -> RmsNormOutput<B> {
    let shape = x.shape();
    let dtype = x.dtype();
    let (x, _) = rows::<B>(x);
    let has_residual = residual.is_some();
    let h = match residual {
        Some(r) => x + rows::<B>(r).0,
        None => x,
    };
    let gamma = f32_of(wrap::<B, 1>(gamma)).unsqueeze_dim::<2>(0);
    let hf = f32_of(h.clone());
    let rstd = (hf.clone().square().mean_dim(1) + epsilon).sqrt().recip();
    let y = to(hf * rstd.clone() * gamma, dtype);
    RmsNormOutput {
        output: prim_as(y, shape.clone()),
        residual: has_residual.then(|| prim_as(h, shape)),
        rstd: prim(rstd.flatten::<1>(0, 1)),
    }
}

pub fn backward<B: Backend>(
    h: FloatTensor<B>,
    gamma: FloatTensor<B>,
    rstd: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = h.shape();
    let (dtype, gamma_dtype) = (h.dtype(), gamma.dtype());
    let (h, _) = rows::<B>(h);
    let (dy, _) = rows::<B>(dy);
    let rstd = f32_of(wrap::<B, 1>(rstd)).unsqueeze_dim::<2>(1);
    let gamma = f32_of(wrap::<B, 1>(gamma)).unsqueeze_dim::<2>(0);
    let n = f32_of(h) * rstd.clone();
    let dy = f32_of(dy);
    let dn = dy.clone() * gamma;
    let mean_dot = (dn.clone() * n.clone()).mean_dim(1);
    let dh = rstd * (dn - n.clone() * mean_dot);
    let dgamma = (dy * n).sum_dim(0).flatten::<1>(0, 1);
    (prim_as(to(dh, dtype), shape), prim(to(dgamma, gamma_dtype)))
}
