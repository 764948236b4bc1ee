//! Per-head RMSNorm followed by RoPE, on q and k in one launch: the "QK-norm" block of Qwen3,
//! Gemma 3 and OLMo 2 (`rope(rms_norm(q_head) · γ_q)`, likewise for k).
//!
//! A row is one head vector of `head_dim` elements. Each unit holds matching vectors of both
//! halves of the head, so the rotation pairs `(i, i + d/2)` meet in registers after the norm and
//! the head is read once and written once. The statistics follow [`crate::rms_norm`]; the rotation
//! follows [`crate::rope`]. Backward, per head: undo the rotation of `dy`, then the RMSNorm
//! backward; dγ is returned as per-cube partials.

use crate::rope::rotate_pair;
use crate::row::{RowLayout, RowTooWide, lane_sum, row_index, row_sum};
use cubecl::prelude::*;

/// Offset (in elements) of the first-half column `col` of the head that a row index names in a
/// strided `[batch, seq, heads, head_dim]` tensor, and its sequence position.
#[cube]
fn head_source<F: Float, N: Size>(x: &Tensor<Vector<F, N>>, row: usize) -> (usize, usize) {
    let heads = x.shape(2);
    let seq = x.shape(1);
    let h = row % heads;
    let s = (row / heads) % seq;
    let b = row / (heads * seq);
    (b * x.stride(0) + s * x.stride(1) + h * x.stride(2), s)
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_rope_forward_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    q_gamma: &Tensor<Vector<F, N>>,
    k_gamma: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    q_out: &mut Tensor<Vector<F, N>>,
    k_out: &mut Tensor<Vector<F, N>>,
    q_rstd: &mut Tensor<f32>,
    k_rstd: &mut Tensor<f32>,
    q_rows: usize,
    k_rows: usize,
    position_offset: usize,
    epsilon: f32,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(layout);
    let is_q = row < q_rows;
    let valid = row < q_rows + k_rows;
    let mut local = row;
    if !is_q {
        local = row - q_rows;
    }
    let head_dim = q.shape(3);
    let half = head_dim / 2;
    let (mut src, mut s) = head_source(q, local);
    if !is_q {
        let (k_src, k_s) = head_source(k, local);
        src = k_src;
        s = k_s;
    }
    let mut first = Array::<Vector<f32, N>>::new(layout.vectors_per_unit);
    let mut second = Array::<Vector<f32, N>>::new(layout.vectors_per_unit);
    let mut squares = Vector::<f32, N>::new(0.0);
    #[unroll]
    for i in 0..layout.vectors_per_unit {
        let col = (i * layout.units_per_row + UNIT_POS_X as usize) * N::value();
        let mut a = Vector::<f32, N>::new(0.0);
        let mut b = Vector::<f32, N>::new(0.0);
        if valid && col < half {
            let at = (src + col) / N::value();
            let bt = (src + col + half) / N::value();
            if is_q {
                a = Vector::cast_from(q[at]);
                b = Vector::cast_from(q[bt]);
            } else {
                a = Vector::cast_from(k[at]);
                b = Vector::cast_from(k[bt]);
            }
        }
        squares += a * a + b * b;
        first[i] = a;
        second[i] = b;
    }
    let total = row_sum(lane_sum(squares), layout);
    let r = (total / f32::cast_from(head_dim) + epsilon).inverse_sqrt();
    if valid {
        if UNIT_POS_X == 0 {
            if is_q {
                q_rstd[local] = r;
            } else {
                k_rstd[local] = r;
            }
        }
        let rv = Vector::<f32, N>::new(r);
        let dst = local * head_dim;
        #[unroll]
        for i in 0..layout.vectors_per_unit {
            let col = (i * layout.units_per_row + UNIT_POS_X as usize) * N::value();
            if col < half {
                let angle = ((position_offset + s) * half + col) / N::value();
                let ga = col / N::value();
                let gb = (col + half) / N::value();
                let mut g1 = Vector::<f32, N>::cast_from(k_gamma[ga]);
                let mut g2 = Vector::<f32, N>::cast_from(k_gamma[gb]);
                if is_q {
                    g1 = Vector::cast_from(q_gamma[ga]);
                    g2 = Vector::cast_from(q_gamma[gb]);
                }
                let (o1, o2) = rotate_pair(first[i] * rv * g1, second[i] * rv * g2, cos[angle], sin[angle]);
                let at = (dst + col) / N::value();
                let bt = (dst + col + half) / N::value();
                if is_q {
                    q_out[at] = Vector::cast_from(o1);
                    q_out[bt] = Vector::cast_from(o2);
                } else {
                    k_out[at] = Vector::cast_from(o1);
                    k_out[bt] = Vector::cast_from(o2);
                }
            }
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_rope_backward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    gamma: &Tensor<Vector<F, N>>,
    rstd: &Tensor<f32>,
    dy: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    dgamma_partials: &mut Tensor<Vector<f32, N>>,
    rows: usize,
    position_offset: usize,
    iterations: usize,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let head_dim = x.shape(3);
    let half = head_dim / 2;
    let inv_width = 1.0f32 / f32::cast_from(head_dim);
    let vpu = layout.vectors_per_unit;
    let mut g1 = Array::<Vector<f32, N>>::new(vpu);
    let mut g2 = Array::<Vector<f32, N>>::new(vpu);
    let mut dg1 = Array::<Vector<f32, N>>::new(vpu);
    let mut dg2 = Array::<Vector<f32, N>>::new(vpu);
    #[unroll]
    for i in 0..vpu {
        let col = (i * layout.units_per_row + UNIT_POS_X as usize) * N::value();
        g1[i] = Vector::new(0.0);
        g2[i] = Vector::new(0.0);
        dg1[i] = Vector::new(0.0);
        dg2[i] = Vector::new(0.0);
        if col < half {
            g1[i] = Vector::cast_from(gamma[col / N::value()]);
            g2[i] = Vector::cast_from(gamma[(col + half) / N::value()]);
        }
    }
    let mut n1 = Array::<Vector<f32, N>>::new(vpu);
    let mut n2 = Array::<Vector<f32, N>>::new(vpu);
    let mut dn1 = Array::<Vector<f32, N>>::new(vpu);
    let mut dn2 = Array::<Vector<f32, N>>::new(vpu);
    for iteration in 0..iterations {
        let row = (iteration * CUBE_COUNT + CUBE_POS) * layout.rows_per_cube + UNIT_POS_Y as usize;
        let valid = row < rows;
        let (src, s) = head_source(x, row);
        let dst = row * head_dim;
        let mut r = 0.0f32;
        if valid {
            r = rstd[row];
        }
        let rv = Vector::<f32, N>::new(r);
        let mut dot = Vector::<f32, N>::new(0.0);
        #[unroll]
        for i in 0..vpu {
            let col = (i * layout.units_per_row + UNIT_POS_X as usize) * N::value();
            let mut a = Vector::<f32, N>::new(0.0);
            let mut b = Vector::<f32, N>::new(0.0);
            let mut da = Vector::<f32, N>::new(0.0);
            let mut db = Vector::<f32, N>::new(0.0);
            if valid && col < half {
                a = Vector::<f32, N>::cast_from(x[(src + col) / N::value()]) * rv;
                b = Vector::<f32, N>::cast_from(x[(src + col + half) / N::value()]) * rv;
                let angle = ((position_offset + s) * half + col) / N::value();
                let (ua, ub) = rotate_pair(
                    Vector::cast_from(dy[(dst + col) / N::value()]),
                    Vector::cast_from(dy[(dst + col + half) / N::value()]),
                    cos[angle],
                    Vector::new(0.0) - sin[angle],
                );
                da = ua;
                db = ub;
            }
            dg1[i] += da * a;
            dg2[i] += db * b;
            let dna = da * g1[i];
            let dnb = db * g2[i];
            dot += dna * a + dnb * b;
            n1[i] = a;
            n2[i] = b;
            dn1[i] = dna;
            dn2[i] = dnb;
        }
        let mean_dot = Vector::<f32, N>::new(row_sum(lane_sum(dot), layout) * inv_width);
        if valid {
            #[unroll]
            for i in 0..vpu {
                let col = (i * layout.units_per_row + UNIT_POS_X as usize) * N::value();
                if col < half {
                    dx[(dst + col) / N::value()] = Vector::cast_from(rv * (dn1[i] - n1[i] * mean_dot));
                    dx[(dst + col + half) / N::value()] =
                        Vector::cast_from(rv * (dn2[i] - n2[i] * mean_dot));
                }
            }
        }
    }
    let partial = (CUBE_POS * layout.rows_per_cube + UNIT_POS_Y as usize) * head_dim;
    #[unroll]
    for i in 0..vpu {
        let col = (i * layout.units_per_row + UNIT_POS_X as usize) * N::value();
        if col < half {
            dgamma_partials[(partial + col) / N::value()] = dg1[i];
            dgamma_partials[(partial + col + half) / N::value()] = dg2[i];
        }
    }
}

/// Launch plan for the fused kernels on heads of `head_dim` elements.
#[derive(Debug, Clone, Copy)]
pub struct RmsNormRopePlan {
    pub vector_size: usize,
    /// Layout of the forward kernel.
    pub layout: RowLayout,
    /// Layout of the backward kernel (one vector pair per unit: it holds eight row arrays).
    pub backward_layout: RowLayout,
}

impl RmsNormRopePlan {
    /// `vector_size` must divide `head_dim / 2` and all strides of q and k (see
    /// [`crate::rope::rope_vector_size`]).
    pub fn new<R: Runtime>(
        client: &ComputeClient<R>,
        head_dim: usize,
        vector_size: usize,
    ) -> Result<Self, RowTooWide> {
        let pairs = head_dim / 2 / vector_size;
        Ok(Self {
            vector_size,
            layout: RowLayout::new(client, pairs, vector_size * 2, 4)?,
            backward_layout: RowLayout::new(client, pairs, vector_size * 2, 1)?,
        })
    }
}

/// Tensors of one fused forward launch (q and k `[batch, seq, heads, head_dim]`, last stride 1;
/// outputs contiguous; rstd f32 `[batch·seq·heads]`).
pub struct RmsNormRopeForwardArgs<R: Runtime> {
    pub q: TensorArg<R>,
    pub k: TensorArg<R>,
    pub q_gamma: TensorArg<R>,
    pub k_gamma: TensorArg<R>,
    pub cos: TensorArg<R>,
    pub sin: TensorArg<R>,
    pub q_out: TensorArg<R>,
    pub k_out: TensorArg<R>,
    pub q_rstd: TensorArg<R>,
    pub k_rstd: TensorArg<R>,
}

#[allow(clippy::too_many_arguments)]
pub fn launch_forward<R: Runtime>(
    client: &ComputeClient<R>,
    plan: &RmsNormRopePlan,
    dtype: StorageType,
    q_rows: usize,
    k_rows: usize,
    position_offset: usize,
    epsilon: f32,
    args: RmsNormRopeForwardArgs<R>,
) {
    let rows = q_rows + k_rows;
    if rows == 0 {
        return;
    }
    // SAFETY: the host checked shapes, strides against the vector size and the table length;
    // the kernel bound-checks rows and columns.
    unsafe {
        rms_norm_rope_forward_kernel::launch_unchecked::<R>(
            client,
            plan.layout.cube_count(client, rows),
            plan.layout.cube_dim(),
            plan.vector_size,
            args.q,
            args.k,
            args.q_gamma,
            args.k_gamma,
            args.cos,
            args.sin,
            args.q_out,
            args.k_out,
            args.q_rstd,
            args.k_rstd,
            q_rows,
            k_rows,
            position_offset,
            epsilon,
            plan.layout,
            dtype,
        )
    }
}

/// Tensors of one backward launch for a single input (q or k).
pub struct RmsNormRopeBackwardArgs<R: Runtime> {
    pub x: TensorArg<R>,
    pub gamma: TensorArg<R>,
    pub rstd: TensorArg<R>,
    pub dy: TensorArg<R>,
    pub cos: TensorArg<R>,
    pub sin: TensorArg<R>,
    pub dx: TensorArg<R>,
    pub dgamma_partials: TensorArg<R>,
}

#[allow(clippy::too_many_arguments)]
pub fn launch_backward<R: Runtime>(
    client: &ComputeClient<R>,
    plan: &RmsNormRopePlan,
    dtype: StorageType,
    rows: usize,
    cubes: usize,
    position_offset: usize,
    args: RmsNormRopeBackwardArgs<R>,
) {
    let iterations = plan.backward_layout.grid_stride_iterations(rows, cubes);
    // SAFETY: as for the forward; `cubes` cubes write `partial_rows(cubes)` partial rows.
    unsafe {
        rms_norm_rope_backward_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            plan.backward_layout.cube_dim(),
            plan.vector_size,
            args.x,
            args.gamma,
            args.rstd,
            args.dy,
            args.cos,
            args.sin,
            args.dx,
            args.dgamma_partials,
            rows,
            position_offset,
            iterations,
            plan.backward_layout,
            dtype,
        )
    }
}
