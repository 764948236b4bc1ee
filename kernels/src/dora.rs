//! DoRA's rescaling of a LoRA output, forward and backward.
//!
//! DoRA (Liu et al. 2024) writes the adapted weight as `m · (W + ΔW) / ‖W + ΔW‖` per output row,
//! with the norm taken as a constant for the gradient (§4.3). With `u = x · (W + ΔW)ᵀ + b` the
//! LoRA layer's output and `c = m / ‖W + ΔW‖` per output column:
//!
//! - forward: `y = c · (u − b) + b`;
//! - backward: `du = c · dy` and `dm = Σ_rows dy · (u − b) / ‖W + ΔW‖`, the latter as per-lane
//!   f32 partial sums that the caller reduces (a small `[lanes, width]` tensor).
//!
//! Both are one pass over `[rows, width]`; the magnitude, norm and bias are read per column. All
//! arithmetic is f32; the norm is f32 whatever the storage dtype.
//!
//! The norm `‖W + ΔW‖` per output row comes from its factored form (two launches, after the base
//! layer has been applied to `A`'s rows, `a_w = A · Wᵀ` `[r, out]`):
//!
//! - the Gram matrix `G = A · Aᵀ` `[r, r]`, one in-cube reduction over `in` per pair `j ≤ k`;
//! - per output `o`: `‖W_o‖² + 2s · Σ_k B_ok · a_w[k, o] + s² · B_o · G · B_oᵀ`, the units of a row
//!   splitting `k`, clamped at zero before the square root.

use crate::row::{RowLayout, elementwise_geometry, lane_sum, row_index, row_sum};
use cubecl::prelude::*;

/// `c = m / n` and the bias of column vector `col`.
#[cube]
fn column<F: Float, N: Size>(
    magnitude: &Array<Vector<F, N>>,
    norm: &Array<Vector<f32, N>>,
    bias: &Array<Vector<F, N>>,
    col: usize,
    #[comptime] has_bias: bool,
) -> (Vector<f32, N>, Vector<f32, N>) {
    let c = Vector::<f32, N>::cast_from(magnitude[col]) / norm[col];
    let mut b = Vector::<f32, N>::new(0.0);
    if comptime!(has_bias) {
        b = Vector::cast_from(bias[col]);
    }
    (c, b)
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dora_forward_kernel<F: Float, N: Size>(
    u: &Array<Vector<F, N>>,
    magnitude: &Array<Vector<F, N>>,
    norm: &Array<Vector<f32, N>>,
    bias: &Array<Vector<F, N>>,
    y: &mut Array<Vector<F, N>>,
    total: usize,
    width_vectors: usize,
    #[comptime] has_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let v = ABSOLUTE_POS;
    if v >= total {
        terminate!();
    }
    let (c, b) = column::<F, N>(magnitude, norm, bias, v % width_vectors, has_bias);
    y[v] = Vector::cast_from(c * (Vector::<f32, N>::cast_from(u[v]) - b) + b);
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dora_backward_kernel<F: Float, N: Size>(
    u: &Array<Vector<F, N>>,
    magnitude: &Array<Vector<F, N>>,
    norm: &Array<Vector<f32, N>>,
    bias: &Array<Vector<F, N>>,
    dy: &Array<Vector<F, N>>,
    du: &mut Array<Vector<F, N>>,
    dm_partials: &mut Array<Vector<f32, N>>,
    rows: usize,
    width_vectors: usize,
    iterations: usize,
    #[comptime] has_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    // x: column vectors (consecutive units read consecutive vectors of a row); y: row lanes, each
    // striding over the rows with every lane of the grid.
    let col = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let lane = (CUBE_POS_Y * CUBE_DIM_Y + UNIT_POS_Y) as usize;
    let lanes = (CUBE_COUNT_Y * CUBE_DIM_Y) as usize;
    if col >= width_vectors {
        terminate!();
    }
    let (c, b) = column::<F, N>(magnitude, norm, bias, col, has_bias);
    let mut dm = Vector::<f32, N>::new(0.0);
    for iteration in 0..iterations {
        let row = iteration * lanes + lane;
        if row < rows {
            let i = row * width_vectors + col;
            let g = Vector::<f32, N>::cast_from(dy[i]);
            dm += g * (Vector::<f32, N>::cast_from(u[i]) - b);
            du[i] = Vector::cast_from(g * c);
        }
    }
    dm_partials[lane * width_vectors + col] = dm / norm[col];
}

/// Where the per-column inputs of a launch come from: `magnitude` and `bias` `[width]` in the
/// storage dtype (`bias` read only when `has_bias`; any binding otherwise), `norm` `[width]` f32.
pub struct DoraColumns<R: Runtime> {
    pub magnitude: ArrayArg<R>,
    pub norm: ArrayArg<R>,
    pub bias: ArrayArg<R>,
    pub has_bias: bool,
}

/// Launch `y = c · (u − b) + b` over contiguous `[rows, width]` tensors, `vector_size` dividing
/// `width`.
#[allow(clippy::too_many_arguments)]
pub fn launch_forward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    rows: usize,
    width: usize,
    vector_size: usize,
    columns: DoraColumns<R>,
    u: ArrayArg<R>,
    y: ArrayArg<R>,
) {
    let width_vectors = width / vector_size;
    let total = rows * width_vectors;
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: `u` and `y` hold `rows × width` contiguous elements, the column arrays `width`;
    // `vector_size` divides `width`, so every vector lies in one row; units past `total` exit.
    unsafe {
        dora_forward_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            vector_size,
            u,
            columns.magnitude,
            columns.norm,
            columns.bias,
            y,
            total,
            width_vectors,
            columns.has_bias,
            dtype,
        )
    }
}

/// The backward's grid: `32 × 8` units a cube, enough row lanes to fill the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoraBackwardPlan {
    pub column_cubes: usize,
    pub lane_cubes: usize,
}

impl DoraBackwardPlan {
    const UNITS_X: usize = 32;
    const UNITS_Y: usize = 8;

    pub fn new<R: Runtime>(client: &ComputeClient<R>, rows: usize, width_vectors: usize) -> Self {
        const CUBES_PER_MULTIPROCESSOR: usize = 8;
        let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(64) as usize;
        let column_cubes = width_vectors.div_ceil(Self::UNITS_X).max(1);
        let wanted = (sms * CUBES_PER_MULTIPROCESSOR).div_ceil(column_cubes);
        let lane_cubes = wanted.clamp(1, rows.div_ceil(Self::UNITS_Y).max(1));
        Self { column_cubes, lane_cubes }
    }

    /// Rows of the f32 `dm` partial sums: one per row lane.
    pub fn partial_rows(&self) -> usize {
        self.lane_cubes * Self::UNITS_Y
    }
}

/// Arguments of one backward launch.
pub struct DoraBackwardArgs<R: Runtime> {
    pub u: ArrayArg<R>,
    pub dy: ArrayArg<R>,
    pub du: ArrayArg<R>,
    /// `plan.partial_rows() × width` f32 values; their column sums are `dm`.
    pub dm_partials: ArrayArg<R>,
}

/// Launch the backward over contiguous `[rows, width]` tensors, `vector_size` dividing `width`.
#[allow(clippy::too_many_arguments)]
pub fn launch_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    plan: DoraBackwardPlan,
    rows: usize,
    width: usize,
    vector_size: usize,
    columns: DoraColumns<R>,
    args: DoraBackwardArgs<R>,
) {
    let width_vectors = width / vector_size;
    let lanes = plan.partial_rows();
    // SAFETY: `u`, `dy`, `du` hold `rows × width` contiguous elements, the column arrays `width`,
    // the partials `lanes × width`; units past the last column exit before any access, rows are
    // bound-checked, and each lane writes its own partial row.
    unsafe {
        dora_backward_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(plan.column_cubes as u32, plan.lane_cubes as u32, 1),
            CubeDim::new_2d(DoraBackwardPlan::UNITS_X as u32, DoraBackwardPlan::UNITS_Y as u32),
            vector_size,
            args.u,
            columns.magnitude,
            columns.norm,
            columns.bias,
            args.dy,
            args.du,
            args.dm_partials,
            rows,
            width_vectors,
            rows.div_ceil(lanes),
            columns.has_bias,
            dtype,
        )
    }
}

/// `gram[j, k] = gram[k, j] = Σ_i a[j, i] · a[k, i]` over `a` `[rank, width]`: one row slot of the
/// layout per pair `(j, k)`; the slot of `j ≤ k` computes and writes both entries, the other slots
/// only take part in the reduction.
#[cube(launch_unchecked)]
fn dora_gram_kernel<F: Float, N: Size>(
    a: &Array<Vector<F, N>>,
    gram: &mut Array<f32>,
    rank: usize,
    width_vectors: usize,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let pair = row_index(layout);
    let j = pair / rank;
    let k = pair % rank;
    let owner = pair < rank * rank && j <= k;
    let mut acc = Vector::<f32, N>::new(0.0);
    if owner {
        let row_j = j * width_vectors;
        let row_k = k * width_vectors;
        let mut v = UNIT_POS_X as usize;
        while v < width_vectors {
            acc += Vector::<f32, N>::cast_from(a[row_j + v]) * Vector::<f32, N>::cast_from(a[row_k + v]);
            v += layout.units_per_row;
        }
    }
    let total = row_sum(lane_sum::<N>(acc), layout);
    if owner && UNIT_POS_X == 0 {
        gram[j * rank + k] = total;
        gram[k * rank + j] = total;
    }
}

/// `norm[o] = √max(0, ‖W_o‖² + 2s · Σ_k b[o, k] · a_w[k, o] + s² · Σ_jk b[o, j] · G[j, k] · b[o, k])`:
/// one row slot of the layout per output, its units splitting `k`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dora_norm_kernel<F: Float>(
    weight_norms_sq: &Array<f32>,
    a_w: &Array<F>,
    b: &Array<F>,
    gram: &Array<f32>,
    norm: &mut Array<f32>,
    rank: usize,
    outputs: usize,
    scale: f32,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let o = row_index(layout);
    let valid = o < outputs;
    // Separate `let`s: a destructured `let` of literals compiles to constants in CubeCL.
    let mut cross = 0.0f32;
    let mut quadratic = 0.0f32;
    if valid {
        let row = o * rank;
        for j in 0..rank {
            // Σ over this unit's k of G[j, k] · b[o, k]; b[o, j] is the same address for the row.
            let mut g_b = 0.0f32;
            let mut k = UNIT_POS_X as usize;
            while k < rank {
                g_b += gram[j * rank + k] * f32::cast_from(b[row + k]);
                k += layout.units_per_row;
            }
            quadratic += f32::cast_from(b[row + j]) * g_b;
        }
        let mut k = UNIT_POS_X as usize;
        while k < rank {
            cross += f32::cast_from(b[row + k]) * f32::cast_from(a_w[k * outputs + o]);
            k += layout.units_per_row;
        }
    }
    let update = row_sum(2.0 * scale * cross + scale * scale * quadratic, layout);
    if valid && UNIT_POS_X == 0 {
        let zero = 0.0f32;
        norm[o] = (weight_norms_sq[o] + update).max(zero).sqrt();
    }
}

/// The two launches of [`launch_norm`]: the Gram matrix's reduction over `in` and the per-output
/// quadratic form over `r`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoraNormPlan {
    pub gram: RowLayout,
    pub norm: RowLayout,
    /// Elements per load of `A`'s rows (divides `in`).
    pub vector_size: usize,
}

impl DoraNormPlan {
    /// Gram pairs take about four vectors of `A`'s rows a unit; outputs one unit per `k`, up to a
    /// cube.
    pub fn new<R: Runtime>(client: &ComputeClient<R>, rank: usize, width: usize, vector_size: usize) -> Self {
        let layout = |vectors, per_unit| RowLayout::new(client, vectors, 1, per_unit).expect("a loop-over-the-row layout is never too wide");
        Self { gram: layout((width / vector_size).max(1), 4), norm: layout(rank.max(1), 1), vector_size }
    }
}

/// Arguments of [`launch_norm`]: `a` `[r, in]`, `a_w` `[r, out]` and `b` `[out, r]` contiguous in
/// one storage dtype; `weight_norms_sq` `[out]`, `gram` `[r, r]` (scratch) and `norm` `[out]` f32.
pub struct DoraNormArgs<R: Runtime> {
    pub weight_norms_sq: ArrayArg<R>,
    pub a_w: ArrayArg<R>,
    pub a: ArrayArg<R>,
    pub b: ArrayArg<R>,
    pub gram: ArrayArg<R>,
    /// `gram` again for the second launch (an `ArrayArg` is consumed by a launch and does not
    /// clone).
    pub gram_read: ArrayArg<R>,
    pub norm: ArrayArg<R>,
}

/// Launch DoRA's factored weight norm for an adapter of rank `rank` over `[in → out]`.
#[allow(clippy::too_many_arguments)]
pub fn launch_norm<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    plan: DoraNormPlan,
    rank: usize,
    width: usize,
    outputs: usize,
    scale: f32,
    args: DoraNormArgs<R>,
) {
    // SAFETY: `a` holds `rank × width` elements and `vector_size` divides `width`; pairs past
    // `rank²` read nothing and write nothing; `gram` holds `rank²` f32.
    unsafe {
        dora_gram_kernel::launch_unchecked::<R>(
            client,
            plan.gram.cube_count(client, rank * rank),
            plan.gram.cube_dim(),
            plan.vector_size,
            args.a,
            args.gram,
            rank,
            width / plan.vector_size,
            plan.gram,
            dtype,
        )
    }
    // SAFETY: `a_w` holds `rank × outputs` elements, `b` `outputs × rank`, `gram` `rank²`,
    // `weight_norms_sq` and `norm` `outputs`; rows past `outputs` read and write nothing, `k < rank`.
    unsafe {
        dora_norm_kernel::launch_unchecked::<R>(
            client,
            plan.norm.cube_count(client, outputs),
            plan.norm.cube_dim(),
            args.weight_norms_sq,
            args.a_w,
            args.b,
            args.gram_read,
            args.norm,
            rank,
            outputs,
            scale,
            plan.norm,
            dtype,
        )
    }
}
