//! Rotary position embedding in the "rotate half" convention of HF Llama/Qwen: element `i` of the
//! first half of a head is paired with element `i + d/2`,
//! `out₁ = x₁·cos − x₂·sin`, `out₂ = x₂·cos + x₁·sin`, with the angle of position `p` and pair `i`
//! read from f32 tables `cos/sin[p, i]`. The inverse rotation (negated sine) is the backward.
//!
//! Input `[batch, seq, heads, head_dim]` may be any strided view whose last axis is contiguous, so
//! a `[batch, heads, seq, head_dim]` tensor passes as `swap_dims(1, 2)` without a copy; the output
//! is contiguous `[batch, seq, heads, head_dim]`.

use crate::row::vector_size_for;
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

/// One cube per token `(batch, position)`: units along x walk the vector pairs of a head, units
/// along y walk the heads. A unit loads the angle of its pair once and applies it to every head
/// it visits, and no index is recovered by division (64-bit divisions cost more than the
/// memory traffic of this kernel).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    out: &mut Tensor<Vector<F, N>>,
    position_offset: usize,
    #[comptime] inverse: bool,
    #[define(F)] _dtype: StorageType,
) {
    let s = CUBE_POS_X as usize;
    let b = CUBE_POS_Y as usize;
    let seq = x.shape(1);
    let heads = x.shape(2);
    let head_dim = x.shape(3);
    let half = head_dim / 2;
    let pairs = half / N::value();
    let token_src = b * x.stride(0) + s * x.stride(1);
    let token_dst = (b * seq + s) * heads * head_dim;
    let mut pair = UNIT_POS_X as usize;
    while pair < pairs {
        let col = pair * N::value();
        let angle = ((position_offset + s) * half + col) / N::value();
        let c = cos[angle];
        let mut sn = sin[angle];
        if comptime!(inverse) {
            // (0 − x, not −x: CUDA's vector types have no unary minus.)
            sn = Vector::new(0.0) - sn;
        }
        let mut h = UNIT_POS_Y as usize;
        while h < heads {
            let src = token_src + h * x.stride(2) + col;
            let x1 = Vector::<f32, N>::cast_from(x[src / N::value()]);
            let x2 = Vector::<f32, N>::cast_from(x[(src + half) / N::value()]);
            let (o1, o2) = rotate_pair(x1, x2, c, sn);
            let dst = token_dst + h * head_dim + col;
            out[dst / N::value()] = Vector::cast_from(o1);
            out[(dst + half) / N::value()] = Vector::cast_from(o2);
            h += CUBE_DIM_Y as usize;
        }
        pair += CUBE_DIM_X as usize;
    }
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
    if batch * seq * heads * head_dim == 0 {
        return;
    }
    let pairs = (head_dim / 2 / vector_size) as u32;
    let max_units = client.properties().hardware.max_units_per_cube.min(256);
    let dim_x = pairs.min(max_units);
    let dim_y = (max_units / dim_x).min(heads as u32).max(1);
    let count = CubeCount::Static(seq as u32, batch as u32, 1);
    // SAFETY: the host checked the shape (seq < 2³¹, batch < 2¹⁶ cubes), that the tables cover
    // `position_offset + seq` positions and that `vector_size` divides the half head and all
    // strides of `x`; the loops stay inside the head and head counts.
    unsafe {
        rope_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_2d(dim_x, dim_y),
            vector_size,
            x,
            cos,
            sin,
            out,
            position_offset,
            inverse,
            dtype,
        )
    }
}
