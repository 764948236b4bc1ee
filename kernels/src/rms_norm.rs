//! Fused RMSNorm with an optional fused residual add, forward and backward.
//!
//! Forward, per row: `h = x (+ residual)`, `rstd = 1/sqrt(mean(h²) + eps)`, `y = h · rstd · γ`.
//! `h` is rounded to the storage dtype before the statistics (as the unfused `x + residual`
//! would be), all arithmetic is f32, and `rstd` is saved (f32) for the backward.
//!
//! Backward, per row with `n = h · rstd`: `dn = dy · γ`,
//! `dh = rstd · (dn − n · mean(dn · n))` and `dγ = Σ_rows dy · n`, the latter
//! as per-cube partial sums that the caller reduces (one small `[partials, width]` f32 tensor).

use crate::row::{RowLayout, RowTooWide, lane_sum, row_index, row_sum, vector_size_for};
use cubecl::prelude::*;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_forward_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    residual: &Array<Vector<F, N>>,
    gamma: &Array<Vector<F, N>>,
    y: &mut Array<Vector<F, N>>,
    residual_out: &mut Array<Vector<F, N>>,
    rstd: &mut Array<f32>,
    rows: usize,
    width: usize,
    epsilon: f32,
    #[comptime] layout: RowLayout,
    #[comptime] has_residual: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(layout);
    let row_valid = row < rows;
    let width_vectors = width / N::value();
    let base = row * width_vectors;
    let mut h = Array::<Vector<f32, N>>::new(layout.vectors_per_unit);
    let mut squares = Vector::<f32, N>::new(0.0);
    #[unroll]
    for i in 0..layout.vectors_per_unit {
        let col = i * layout.units_per_row + UNIT_POS_X as usize;
        let mut value = Vector::<f32, N>::new(0.0);
        if row_valid && col < width_vectors {
            let mut stored = x[base + col];
            if comptime!(has_residual) {
                stored += residual[base + col];
                residual_out[base + col] = stored;
            }
            value = Vector::cast_from(stored);
        }
        squares += value * value;
        h[i] = value;
    }
    let total = row_sum(lane_sum(squares), layout);
    let r = (total / f32::cast_from(width) + epsilon).inverse_sqrt();
    if row_valid {
        if UNIT_POS_X == 0 {
            rstd[row] = r;
        }
        let rv = Vector::<f32, N>::new(r);
        #[unroll]
        for i in 0..layout.vectors_per_unit {
            let col = i * layout.units_per_row + UNIT_POS_X as usize;
            if col < width_vectors {
                let g = Vector::<f32, N>::cast_from(gamma[col]);
                y[base + col] = Vector::cast_from(h[i] * rv * g);
            }
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_backward_kernel<F: Float, N: Size>(
    h: &Array<Vector<F, N>>,
    gamma: &Array<Vector<F, N>>,
    rstd: &Array<f32>,
    dy: &Array<Vector<F, N>>,
    dh: &mut Array<Vector<F, N>>,
    dgamma_partials: &mut Array<Vector<f32, N>>,
    rows: usize,
    width: usize,
    iterations: usize,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let width_vectors = width / N::value();
    let inv_width = 1.0f32 / f32::cast_from(width);
    let mut dgamma = Array::<Vector<f32, N>>::new(layout.vectors_per_unit);
    let mut gammas = Array::<Vector<f32, N>>::new(layout.vectors_per_unit);
    #[unroll]
    for i in 0..layout.vectors_per_unit {
        let col = i * layout.units_per_row + UNIT_POS_X as usize;
        dgamma[i] = Vector::new(0.0);
        gammas[i] = Vector::new(0.0);
        if col < width_vectors {
            gammas[i] = Vector::cast_from(gamma[col]);
        }
    }
    let mut n = Array::<Vector<f32, N>>::new(layout.vectors_per_unit);
    let mut dn = Array::<Vector<f32, N>>::new(layout.vectors_per_unit);
    // The slot's next row is loaded before this row's sum, so its reads are in flight while the
    // units wait on each other; loading after the sum left a slot's eight rows one latency each.
    let mut h_row = Array::<Vector<F, N>>::new(layout.vectors_per_unit);
    let mut dy_row = Array::<Vector<F, N>>::new(layout.vectors_per_unit);
    let first_row = CUBE_POS * layout.rows_per_cube + UNIT_POS_Y as usize;
    let mut r = load_backward_row(h, rstd, dy, &mut h_row, &mut dy_row, first_row, rows, width_vectors, layout);
    // Grid-stride over rows with a uniform trip count, so every unit reaches each reduction.
    for iteration in 0..iterations {
        let row = (iteration * CUBE_COUNT + CUBE_POS) * layout.rows_per_cube + UNIT_POS_Y as usize;
        let row_valid = row < rows;
        let base = row * width_vectors;
        let rv = Vector::<f32, N>::new(r);
        let mut dot = Vector::<f32, N>::new(0.0);
        #[unroll]
        for i in 0..layout.vectors_per_unit {
            let nv = Vector::<f32, N>::cast_from(h_row[i]) * rv;
            let dyv = Vector::<f32, N>::cast_from(dy_row[i]);
            dgamma[i] += dyv * nv;
            let dnv = dyv * gammas[i];
            dot += dnv * nv;
            n[i] = nv;
            dn[i] = dnv;
        }
        let r_following = load_backward_row(h, rstd, dy, &mut h_row, &mut dy_row, row + CUBE_COUNT * layout.rows_per_cube, rows, width_vectors, layout);
        let mean_dot = Vector::<f32, N>::new(row_sum(lane_sum(dot), layout) * inv_width);
        if row_valid {
            #[unroll]
            for i in 0..layout.vectors_per_unit {
                let col = i * layout.units_per_row + UNIT_POS_X as usize;
                if col < width_vectors {
                    dh[base + col] = Vector::cast_from(rv * (dn[i] - n[i] * mean_dot));
                }
            }
        }
        // Assigned after this row's last use: `rv` may name `r` itself (a one-lane vector).
        r = r_following;
    }
    let partial_row = CUBE_POS * layout.rows_per_cube + UNIT_POS_Y as usize;
    #[unroll]
    for i in 0..layout.vectors_per_unit {
        let col = i * layout.units_per_row + UNIT_POS_X as usize;
        if col < width_vectors {
            dgamma_partials[partial_row * width_vectors + col] = dgamma[i];
        }
    }
}

/// This unit's share of row `row` of `h` and `dy` into `h_row` / `dy_row` (zeros past the last
/// row or column, which then add nothing), returning the row's `rstd` (0 past the last row).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_backward_row<F: Float, N: Size>(
    h: &Array<Vector<F, N>>,
    rstd: &Array<f32>,
    dy: &Array<Vector<F, N>>,
    h_row: &mut Array<Vector<F, N>>,
    dy_row: &mut Array<Vector<F, N>>,
    row: usize,
    rows: usize,
    width_vectors: usize,
    #[comptime] layout: RowLayout,
) -> f32 {
    let row_valid = row < rows;
    let base = row * width_vectors;
    #[unroll]
    for i in 0..layout.vectors_per_unit {
        let col = i * layout.units_per_row + UNIT_POS_X as usize;
        h_row[i] = Vector::new(F::new(0.0));
        dy_row[i] = Vector::new(F::new(0.0));
        if row_valid && col < width_vectors {
            h_row[i] = h[base + col];
            dy_row[i] = dy[base + col];
        }
    }
    let mut r = 0.0f32;
    if row_valid {
        r = rstd[row];
    }
    r
}

/// Launch plan for the RMSNorm kernels on rows of `width` elements of `elem_size` bytes.
#[derive(Debug, Clone, Copy)]
pub struct RmsNormPlan {
    pub vector_size: usize,
    /// Layout of the forward kernel.
    pub layout: RowLayout,
    /// Layout of the backward kernel: one vector a unit (it holds six row arrays), which ran
    /// 1.3–1.5× faster than two on the H200 (`benches/RESULTS.md`, forty-fifth session).
    pub backward_layout: RowLayout,
}

impl RmsNormPlan {
    pub fn new<R: Runtime>(
        client: &ComputeClient<R>,
        width: usize,
        elem_size: usize,
    ) -> Result<Self, RowTooWide> {
        // 16-byte loads for the storage dtype; f32 partials of dγ then use up to 4×vector bytes.
        let vector_size = vector_size_for(client, width, elem_size, 16);
        let width_vectors = width / vector_size;
        let backward_vectors = crate::measurement_override("KILN_RMS_NORM_BACKWARD_VECTORS", 1..=8).unwrap_or(1);
        Ok(Self {
            vector_size,
            layout: RowLayout::new(client, width_vectors, vector_size, 4)?,
            backward_layout: RowLayout::new(client, width_vectors, vector_size, backward_vectors)?,
        })
    }
}

/// Arguments of one RMSNorm forward launch. `residual`/`residual_out` are read/written only when
/// `has_residual`; otherwise any valid bindings may be passed.
pub struct RmsNormForwardArgs<R: Runtime> {
    pub x: ArrayArg<R>,
    pub residual: ArrayArg<R>,
    pub gamma: ArrayArg<R>,
    pub y: ArrayArg<R>,
    pub residual_out: ArrayArg<R>,
    pub rstd: ArrayArg<R>,
    pub has_residual: bool,
}

/// Launch the forward over contiguous `[rows, width]` tensors of `dtype`.
pub fn launch_forward<R: Runtime>(
    client: &ComputeClient<R>,
    plan: &RmsNormPlan,
    dtype: StorageType,
    rows: usize,
    width: usize,
    epsilon: f32,
    args: RmsNormForwardArgs<R>,
) {
    if rows == 0 {
        return;
    }
    // SAFETY: the host checked shapes: every tensor holds `rows × width` (γ `width`, rstd `rows`)
    // contiguous elements, `vector_size` divides `width`, and the kernel bound-checks rows and
    // columns against those sizes.
    unsafe {
        rms_norm_forward_kernel::launch_unchecked::<R>(
            client,
            plan.layout.cube_count(client, rows),
            plan.layout.cube_dim(),
            plan.vector_size,
            args.x,
            args.residual,
            args.gamma,
            args.y,
            args.residual_out,
            args.rstd,
            rows,
            width,
            epsilon,
            plan.layout,
            args.has_residual,
            dtype,
        )
    }
}

/// Arguments of one RMSNorm backward launch (`h` is the normalized input, `x + residual` when the
/// forward had a residual: its gradient flows to both).
pub struct RmsNormBackwardArgs<R: Runtime> {
    pub h: ArrayArg<R>,
    pub gamma: ArrayArg<R>,
    pub rstd: ArrayArg<R>,
    pub dy: ArrayArg<R>,
    pub dh: ArrayArg<R>,
    pub dgamma_partials: ArrayArg<R>,
}

/// Launch the backward with `cubes` cubes (see [`RowLayout::grid_stride_cubes`] of
/// `plan.backward_layout`); `dgamma_partials`
/// must hold `plan.backward_layout.partial_rows(cubes) × width` f32 values.
pub fn launch_backward<R: Runtime>(
    client: &ComputeClient<R>,
    plan: &RmsNormPlan,
    dtype: StorageType,
    rows: usize,
    width: usize,
    cubes: usize,
    args: RmsNormBackwardArgs<R>,
) {
    let iterations = plan.backward_layout.grid_stride_iterations(rows, cubes);
    // SAFETY: as for the forward; `cubes` cubes write exactly `partial_rows(cubes)` partial rows.
    unsafe {
        rms_norm_backward_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            plan.backward_layout.cube_dim(),
            plan.vector_size,
            args.h,
            args.gamma,
            args.rstd,
            args.dy,
            args.dh,
            args.dgamma_partials,
            rows,
            width,
            iterations,
            plan.backward_layout,
            dtype,
        )
    }
}
