//! Cross-entropy from plain Burn tensor ops, in f32 (f64 for f64 logits).

use burn::tensor::{FloatDType, Int, Tensor, TensorMetadata, backend::Backend, ops::{FloatTensor, IntTensor}};

use crate::ops::{compute_dtype, prim, wrap};

/// `(negative, past the row)` masks of the targets of rows `width` wide.
fn outside<B: Backend>(targets: &Tensor<B, 1, Int>, width: usize) -> (Tensor<B, 1, burn::tensor::Bool>, Tensor<B, 1, burn::tensor::Bool>) {
    (targets.clone().lower_elem(0), targets.clone().greater_equal_elem(width as i64))
}

pub fn forward<B: Backend>(logits: FloatTensor<B>, targets: IntTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let work = compute_dtype(logits.dtype());
    let z = wrap::<B, 2>(logits).cast(work);
    let [rows, width] = z.dims();
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let top = z.clone().max_dim(1);
    let lse = top.clone() + (z.clone() - top).exp().sum_dim(1).log();
    let picked = z.gather(1, targets.clone().clamp(0, width as i64 - 1).reshape([rows, 1]));
    let (ignored, past) = outside(&targets, width);
    let loss = (lse.clone() - picked).reshape([rows]).mask_fill(ignored, 0.0).mask_fill(past, f64::NAN);
    (prim(loss), prim(lse.reshape([rows])))
}

pub fn backward<B: Backend>(logits: FloatTensor<B>, targets: IntTensor<B>, lse: FloatTensor<B>, dloss: FloatTensor<B>) -> FloatTensor<B> {
    let dtype = FloatDType::from(logits.dtype());
    let work = compute_dtype(logits.dtype());
    let z = wrap::<B, 2>(logits).cast(work);
    let [rows, width] = z.dims();
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let (ignored, past) = outside(&targets, width);
    let g = wrap::<B, 1>(dloss).cast(work).mask_fill(ignored, 0.0).mask_fill(past, f64::NAN).reshape([rows, 1]);
    let p = (z - wrap::<B, 1>(lse).cast(work).reshape([rows, 1])).exp();
    let classes = Tensor::<B, 1, Int>::arange(0..width as i64, &p.device()).reshape([1, width]).expand([rows, width]);
    let onehot = classes.equal(targets.reshape([rows, 1]).expand([rows, width])).float().cast(work);
    prim(((p - onehot) * g).cast(dtype))
}
