//! Rotary position embedding in the "rotate half" convention of HF Llama/Qwen: element `i` of the
//! first half of a head is paired with element `i + d/2`,
//! `out₁ = x₁·cos − x₂·sin`, `out₂ = x₂·cos + x₁·sin`, with the angle of position `p` and pair `i`
//! read from f32 tables `cos/sin[p, i]`. The inverse rotation (negated sine) is the backward.
//!
//! Input `[batch, seq, heads, head_dim]` may be any strided view whose last axis is contiguous, so
//! a `[batch, heads, seq, head_dim]` tensor passes as `swap_dims(1, 2)` without a copy; the output
//! is contiguous `[batch, seq, heads, head_dim]`.

use crate::row::{elementwise_geometry, vector_size_for};
use cubecl::prelude::*;

/// Rotate the pair `(a, b)` of vectors by the angle whose cosine and sine are given.
#[cube]
pub fn rotate_pair<N: Size>(
    a: Vector<f32, N>,
    b: Vector<f32, N>,
    cos: Vector<f32, N>,
    sin: Vector<f32, N>,
) -> (Vector<f32, N>, Vector<f32, N>) {
    (a * cos - b * sin, b * cos + a * sin)
}

/// Element offsets of the first-half vector `pair` of head `(b, s, h)` in a strided 4-D input,
/// given the linear index of a unit over `[batch, seq, heads, half/vector]`.
#[cube]
pub fn head_coordinates(index: usize, seq: usize, heads: usize, pairs: usize) -> (usize, usize, usize, usize) {
    let pair = index % pairs;
    let rest = index / pairs;
    let head = rest % heads;
    let rest = rest / heads;
    (rest / seq, rest % seq, head, pair)
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    out: &mut Tensor<Vector<F, N>>,
    total: usize,
    position_offset: usize,
    #[comptime] inverse: bool,
    #[define(F)] _dtype: StorageType,
) {
    let index = ABSOLUTE_POS;
    if index >= total {
        terminate!();
    }
    let seq = x.shape(1);
    let heads = x.shape(2);
    let head_dim = x.shape(3);
    let half = head_dim / 2;
    let pairs = half / N::value();
    let (b, s, h, pair) = head_coordinates(index, seq, heads, pairs);
    let col = pair * N::value();
    let src = b * x.stride(0) + s * x.stride(1) + h * x.stride(2) + col;
    let x1 = Vector::<f32, N>::cast_from(x[src / N::value()]);
    let x2 = Vector::<f32, N>::cast_from(x[(src + half) / N::value()]);
    let angle = ((position_offset + s) * half + col) / N::value();
    let c = cos[angle];
    let mut sn = sin[angle];
    if comptime!(inverse) {
        // (0 − x, not −x: CUDA's vector types have no unary minus.)
        sn = Vector::new(0.0) - sn;
    }
    let (o1, o2) = rotate_pair(x1, x2, c, sn);
    let dst = ((b * seq + s) * heads + h) * head_dim + col;
    out[dst / N::value()] = Vector::cast_from(o1);
    out[(dst + half) / N::value()] = Vector::cast_from(o2);
}

/// Vector width for heads of `head_dim` elements: it must divide the half head and every stride.
pub fn rope_vector_size<R: Runtime>(
    client: &ComputeClient<R>,
    head_dim: usize,
    strides: &[usize],
    elem_size: usize,
) -> usize {
    let half = head_dim / 2;
    let mut v = vector_size_for(client, half, elem_size, 16);
    while v > 1 && strides.iter().any(|s| s % v != 0) {
        v /= 2;
    }
    v
}

/// Launch RoPE (or its inverse) over `x: [batch, seq, heads, head_dim]` (last stride 1) into a
/// contiguous `out` of the same shape. `cos`/`sin` are contiguous f32 `[positions, head_dim/2]`
/// with `position_offset + seq <= positions`.
#[allow(clippy::too_many_arguments)]
pub fn launch_rope<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    shape: [usize; 4],
    vector_size: usize,
    x: TensorArg<R>,
    cos: TensorArg<R>,
    sin: TensorArg<R>,
    out: TensorArg<R>,
    position_offset: usize,
    inverse: bool,
) {
    let [batch, seq, heads, head_dim] = shape;
    let total = batch * seq * heads * (head_dim / 2 / vector_size);
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: the host checked the shape, that the tables cover `position_offset + seq`
    // positions and that `vector_size` divides the half head and all strides of `x`; units past
    // `total` exit before touching memory.
    unsafe {
        rope_kernel::launch_unchecked::<R>(
            client, count, dim, vector_size, x, cos, sin, out, total, position_offset, inverse, dtype,
        )
    }
}
