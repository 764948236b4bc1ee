//! RoPE from plain Burn tensor ops (the oracle and the fallback), f32 arithmetic.

use burn::tensor::{FloatDType, Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

use crate::ops::{compute_dtype, prim, wrap};

/// The `[1, seq, 1, half]` f32 angle tables for positions `offset..offset + seq`.
pub(crate) fn angles<B: Backend>(cos: FloatTensor<B>, sin: FloatTensor<B>, offset: usize, seq: usize) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let pick = |t: FloatTensor<B>| wrap::<B, 2>(t).narrow(0, offset, seq).unsqueeze_dims::<4>(&[0, 2]);
    (pick(cos), pick(sin))
}

/// Rotate `[batch, seq, heads, head_dim]` in f32 given f32 angle tables broadcastable to
/// `[batch, seq, heads, half]`; `x` is returned in f32.
pub(crate) fn rotate_f32<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 4> {
    let half = x.dims()[3] / 2;
    let a = x.clone().narrow(3, 0, half);
    let b = x.narrow(3, half, half);
    Tensor::cat(vec![a.clone() * cos.clone() - b.clone() * sin.clone(), b * cos + a * sin], 3)
}

pub fn rotate<B: Backend>(x: FloatTensor<B>, cos: FloatTensor<B>, sin: FloatTensor<B>, offset: usize, inverse: bool) -> FloatTensor<B> {
    let dtype = x.dtype();
    let x = wrap::<B, 4>(x);
    let (cos, sin) = angles::<B>(cos, sin, offset, x.dims()[1]);
    let sin = if inverse { -sin } else { sin };
    let work = compute_dtype(dtype);
    let (cos, sin) = (cos.cast(work), sin.cast(work));
    prim(rotate_f32(x.cast(work), cos, sin).cast(FloatDType::from(dtype)))
}
