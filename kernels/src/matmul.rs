//! Skinny dense products: `out[b] = lhs[b] · rhs[b] (+ bias) (+ residual[b])` where `lhs[b]` has
//! at most [`MAX_ROWS`] rows — every linear layer while a model generates tokens.
//!
//! Such a product reads each `rhs` element once and does `2 · rows` flops with it, so it is bound
//! by how fast `rhs` streams from memory, not by arithmetic, and at decode sizes (a 4096×4096
//! bf16 weight is ~10 µs of H100 bandwidth) by what a call costs on the host. One CubeCL launch
//! on CubeCL's own stream needs no ordering against it; cuBLASLt there needs a cross-stream
//! handshake and a round trip to CubeCL's device thread per call (`benches/RESULTS.md`,
//! 2026-11-24).
//!
//! A cube owns `column_units` column vectors of the output for every row. Its units split the
//! reduction axis: unit `(slice, column)` streams `rhs` rows `k ≡ slice (mod slices)` in chunks,
//! one vector load per row, and keeps every output row's partial sums in registers. The partials
//! are summed across a plane by lane shuffles, then across planes through shared memory.
//! Operands are bound as arrays with their strides as scalars (see the crate docs for why).

use cubecl::prelude::*;

use crate::measurement_override;
use crate::row::{prev_power_of_two, vector_size_for};

/// The most product rows the skinny kernel takes; larger products go to a tiled GEMM.
pub const MAX_ROWS: usize = 16;

/// Registers a unit spends on accumulators (`rows · rhs vector`) and on `lhs` values
/// (`rows · lhs vector`): beyond these the kernel spills or runs one cube per multiprocessor.
const ACCUMULATOR_LANES: usize = 64;
const LHS_LANES: usize = 32;

/// Shared memory the cross-plane reduction may use, small enough for two cubes per multiprocessor
/// on any device.
const SHARED_BYTES: usize = 16 * 1024;

/// Compile-time shape of a skinny launch. Distinct values compile distinct kernels; they depend
/// on the row count (rounded to a power of two), the epilogue and the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SkinnyLayout {
    /// Output rows every unit accumulates: the product's rows rounded up to a power of two (the
    /// extra ones repeat the last row and are not stored).
    pub rows: usize,
    /// Output column vectors per cube (a power of two).
    pub column_units: usize,
    /// Units per cube (a power of two, a multiple of `column_units`).
    pub units: usize,
    /// Consecutive units whose partials lane shuffles sum before shared memory: the plane size,
    /// or `column_units` (no shuffles) without plane operations.
    pub group: usize,
    /// Whether `k` is split over the grid's z axis: each split writes f32 partial sums that
    /// [`launch_skinny`]'s second kernel adds up (with the epilogue).
    pub split: bool,
    pub bias: bool,
    pub residual: bool,
}

/// A product `[batch, m, k] · [batch, k, n]` as the kernel reads it. `lhs` has a unit stride
/// along `k`, `rhs` along `n`; strides are in elements, a batch stride of 0 shares the operand.
/// `bias` (`[n]`), `residual` and `out` (`[batch, m, n]`) are dense.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkinnyProblem {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// `[batch, row]` strides of `lhs`.
    pub lhs_strides: [usize; 2],
    /// `[batch, row]` strides of `rhs`.
    pub rhs_strides: [usize; 2],
    pub elem_size: usize,
    pub bias: bool,
    pub residual: bool,
}

/// Vector widths and layout of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkinnyPlan {
    /// Elements per `lhs` load (a chunk of `k`).
    pub lhs_vector: usize,
    /// Elements per `rhs` load (output columns per unit).
    pub rhs_vector: usize,
    pub layout: SkinnyLayout,
    /// Cubes along the columns; the grid's y axis is the batch.
    pub column_cubes: usize,
    /// Parts `k` is split into (the grid's z axis); above 1 the caller provides an f32 buffer of
    /// `splits × batch × m × n` partial sums.
    pub splits: usize,
}

impl SkinnyProblem {
    /// Whether the kernel takes this product: few rows, a grid the device can launch.
    pub fn fits<R: Runtime>(&self, client: &ComputeClient<R>) -> bool {
        let max_y = client.properties().hardware.max_cube_count.1 as usize;
        (1..=MAX_ROWS).contains(&self.m) && self.k > 0 && self.n > 0 && (1..=max_y).contains(&self.batch)
    }

    /// The vector widths, the split of a cube's units and the grid for this product on `client`.
    pub fn plan<R: Runtime>(&self, client: &ComputeClient<R>) -> SkinnyPlan {
        let props = client.properties();
        let hw = &props.hardware;
        let rows = self.m.next_power_of_two();
        // The widest vector dividing the length and both strides, within 16 bytes and `lanes / rows`
        // elements per row.
        let width = |len: usize, [s0, s1]: [usize; 2], lanes: usize| {
            let max_bytes = (lanes / rows * self.elem_size).min(16);
            vector_size_for(client, gcd(gcd(len, s0), s1), self.elem_size, max_bytes)
        };
        let lhs_vector = width(self.k, self.lhs_strides, LHS_LANES);
        let rhs_vector = width(self.n, self.rhs_strides, ACCUMULATOR_LANES);
        let column_vectors = self.n / rhs_vector;

        // Enough cubes for two per multiprocessor, but at least 32 bytes of a row per cube (one
        // memory sector) and no more columns than there are.
        let multiprocessors = hw.num_streaming_multiprocessors.unwrap_or(16) as usize;
        let min_units = (32 / (rhs_vector * self.elem_size)).max(1);
        let wanted = column_vectors * self.batch / (2 * multiprocessors);
        let column_units = prev_power_of_two(wanted.max(1)).clamp(min_units, 32).min(column_vectors.next_power_of_two());
        let column_units = measurement_override("KILN_SKINNY_COLUMNS", 1..=32).map_or(column_units, prev_power_of_two);
        let splits = measurement_override("KILN_SKINNY_SPLITS", 1..=64).unwrap_or(1).min(self.k / lhs_vector);

        let plane = crate::row::plane_size_for_reduction(client);
        let group = if plane >= column_units { plane } else { column_units };
        let max_units = prev_power_of_two((hw.max_units_per_cube as usize).min(hw.max_cube_dim.0 as usize).clamp(1, 256));
        let shared_bytes = SHARED_BYTES.min(hw.max_shared_memory_size);
        let max_units = measurement_override("KILN_SKINNY_UNITS", 32..=max_units).map_or(max_units, prev_power_of_two);
        let mut units = max_units.max(group);
        while units > group && (units / group) * column_units * rows * rhs_vector * 4 > shared_bytes {
            units /= 2;
        }
        SkinnyPlan {
            lhs_vector,
            rhs_vector,
            // A split product's epilogue runs in the combine step.
            layout: SkinnyLayout { rows, column_units, units, group, split: splits > 1, bias: self.bias && splits == 1, residual: self.residual && splits == 1 },
            column_cubes: column_vectors.div_ceil(column_units),
            splits,
        }
    }
}

/// Greatest common divisor (`gcd(a, 0) = a`).
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn skinny_kernel<F: Float, O: Float, NX: Size, NW: Size>(
    lhs: &Array<Vector<F, NX>>,
    rhs: &Array<Vector<F, NW>>,
    bias: &Array<Vector<F, NW>>,
    residual: &Array<Vector<F, NW>>,
    out: &mut Array<Vector<O, NW>>,
    m: usize,
    chunks: usize,
    chunks_per_split: usize,
    column_vectors: usize,
    lhs_batch_stride: usize,
    lhs_row_stride: usize,
    rhs_batch_stride: usize,
    rhs_row_stride: usize,
    #[comptime] layout: SkinnyLayout,
    #[define(F, O)] _types: [StorageType; 2],
) {
    let rows = layout.rows;
    let units = layout.column_units;
    let slices = comptime!(layout.units / layout.column_units);
    let unit = UNIT_POS as usize % units;
    let slice = UNIT_POS as usize / units;
    let batch = CUBE_POS_Y as usize;
    let split = CUBE_POS_Z as usize;
    let first_column = CUBE_POS_X as usize * units;
    // This cube's chunks of `k`: all of them, or its split's share.
    let first_chunk = split * chunks_per_split;
    let end_chunk = select(first_chunk + chunks_per_split < chunks, first_chunk + chunks_per_split, chunks);
    // Units past the last column read the last one (their sums are discarded), so every unit
    // takes part in the shuffles and the barrier.
    let column = select(first_column + unit < column_vectors, first_column + unit, column_vectors - 1);

    // Offsets of each operand's loads, in vectors (so are the strides).
    let mut lhs_offsets = Array::<usize>::new(rows);
    #[unroll]
    for r in 0..rows {
        let row = select(r < m, r, m - 1);
        lhs_offsets[r] = batch * lhs_batch_stride + row * lhs_row_stride + first_chunk + slice;
    }
    let mut rhs_offset = batch * rhs_batch_stride + (first_chunk + slice) * NX::value() * rhs_row_stride + column;
    let rhs_step = slices * NX::value() * rhs_row_stride;

    let mut acc = Array::<Vector<f32, NW>>::new(rows);
    #[unroll]
    for r in 0..rows {
        acc[r] = Vector::new(0.0);
    }
    let mut xs = Array::<Vector<f32, NX>>::new(rows);
    let mut chunk = first_chunk + slice;
    while chunk < end_chunk {
        #[unroll]
        for r in 0..rows {
            xs[r] = Vector::cast_from(lhs[lhs_offsets[r]]);
            lhs_offsets[r] += slices;
        }
        #[unroll]
        for j in 0..NX::value() {
            let w = Vector::<f32, NW>::cast_from(rhs[rhs_offset + j * rhs_row_stride]);
            #[unroll]
            for r in 0..rows {
                let x = xs[r];
                acc[r] = fma(Vector::new(x[j]), w, acc[r]);
            }
        }
        rhs_offset += rhs_step;
        chunk += slices;
    }

    // A split writes its partial sums at `[split, batch, row, column]`.
    let out_batch = split * CUBE_COUNT_Y as usize + batch;
    reduce_and_store(acc, bias, residual, out, m, column_vectors, out_batch, first_column, layout);
}

/// Sum every unit's partials over the slices of its column and write the output rows (plus the
/// epilogue). Lanes of one column sit `column_units` apart in a plane: a butterfly over the masks
/// `column_units .. group / 2` sums them; the first `column_units` lanes of each group then meet
/// in shared memory, where units pick up `(column, row)` pairs to finish.
#[cube]
#[allow(clippy::too_many_arguments)]
fn reduce_and_store<F: Float, O: Float, NW: Size>(
    mut acc: Array<Vector<f32, NW>>,
    bias: &Array<Vector<F, NW>>,
    residual: &Array<Vector<F, NW>>,
    out: &mut Array<Vector<O, NW>>,
    m: usize,
    column_vectors: usize,
    batch: usize,
    first_column: usize,
    #[comptime] layout: SkinnyLayout,
) {
    let rows = layout.rows;
    let units = layout.column_units;
    let groups = comptime!(layout.units / layout.group);
    #[unroll]
    for step in comptime!(units.trailing_zeros())..comptime!(layout.group.trailing_zeros()) {
        #[unroll]
        for r in 0..rows {
            let own = acc[r];
            acc[r] = own + plane_shuffle_xor(own, 1u32 << step);
        }
    }
    let mut partials = SharedMemory::<Vector<f32, NW>>::new(comptime!(groups * units * rows));
    let lane = UNIT_POS as usize % layout.group;
    if lane < units {
        let base = ((UNIT_POS as usize / layout.group) * units + lane) * rows;
        #[unroll]
        for r in 0..rows {
            partials[base + r] = acc[r];
        }
    }
    sync_cube();

    let mut item = UNIT_POS as usize;
    while item < comptime!(units * rows) {
        let unit = item % units;
        let r = item / units;
        let mut sum = partials[unit * rows + r];
        #[unroll]
        for g in 1..groups {
            sum += partials[(g * units + unit) * rows + r];
        }
        let column = first_column + unit;
        if column < column_vectors && r < m {
            let at = (batch * m + r) * column_vectors + column;
            if comptime!(layout.split) {
                out[at] = Vector::cast_from(sum);
            } else {
                out[at] = Vector::cast_from(epilogue(sum, bias, residual, column, at, layout.bias, layout.residual));
            }
        }
        item += layout.units;
    }
}

/// `sum (+ bias[column]) (+ residual[at])`, in f32.
#[cube]
fn epilogue<F: Float, NW: Size>(
    sum: Vector<f32, NW>,
    bias: &Array<Vector<F, NW>>,
    residual: &Array<Vector<F, NW>>,
    column: usize,
    at: usize,
    #[comptime] with_bias: bool,
    #[comptime] with_residual: bool,
) -> Vector<f32, NW> {
    let mut sum = sum;
    if comptime!(with_bias) {
        sum += Vector::cast_from(bias[column]);
    }
    if comptime!(with_residual) {
        sum += Vector::cast_from(residual[at]);
    }
    sum
}

/// The split product's second step: `out[i] = Σ_split partials[split, i]` plus the epilogue, one
/// unit per output vector.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn skinny_combine_kernel<F: Float, NW: Size>(
    partials: &Array<Vector<f32, NW>>,
    bias: &Array<Vector<F, NW>>,
    residual: &Array<Vector<F, NW>>,
    out: &mut Array<Vector<F, NW>>,
    splits: usize,
    total: usize,
    column_vectors: usize,
    #[comptime] with_bias: bool,
    #[comptime] with_residual: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= total {
        terminate!();
    }
    let mut sum = partials[i];
    for s in 1..splits {
        sum += partials[s * total + i];
    }
    out[i] = Vector::cast_from(epilogue(sum, bias, residual, i % column_vectors, i, with_bias, with_residual));
}

/// Launch the product step of `plan` (from [`SkinnyProblem::plan`]) for a product that
/// [`SkinnyProblem::fits`]. Unsplit, `out` is the `[batch, m, n]` output of `types[1] = types[0]`
/// and the epilogue is applied; split (`plan.splits > 1`), `out` is an f32 buffer of
/// `splits × batch × m × n` partial sums for [`launch_skinny_combine`], and `bias`/`residual` are
/// not read. An absent `bias` or `residual` may be bound to any tensor of `rhs`'s vector width
/// (e.g. `rhs`): the kernel reads them only under the problem's flags.
#[allow(clippy::too_many_arguments)]
pub fn launch_skinny<R: Runtime>(
    client: &ComputeClient<R>,
    types: [StorageType; 2],
    problem: &SkinnyProblem,
    plan: &SkinnyPlan,
    lhs: ArrayArg<R>,
    rhs: ArrayArg<R>,
    bias: ArrayArg<R>,
    residual: ArrayArg<R>,
    out: ArrayArg<R>,
) {
    let (lv, rv) = (plan.lhs_vector, plan.rhs_vector);
    let chunks = problem.k / lv;
    let count = CubeCount::Static(plan.column_cubes as u32, problem.batch as u32, plan.splits as u32);
    // SAFETY: `fits` bounds the grid; every load is clamped into the operands (the last column,
    // the last row, chunks below `k / lhs_vector`), and stores are guarded by the output's rows
    // and columns; the vector widths divide the dimensions and strides they step over.
    unsafe {
        skinny_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(plan.layout.units as u32),
            lv,
            rv,
            lhs,
            rhs,
            bias,
            residual,
            out,
            problem.m,
            chunks,
            chunks.div_ceil(plan.splits),
            problem.n / rv,
            problem.lhs_strides[0] / lv,
            problem.lhs_strides[1] / lv,
            problem.rhs_strides[0] / rv,
            problem.rhs_strides[1] / rv,
            plan.layout,
            types,
        )
    }
}

/// Launch the second step of a split plan: `out = Σ partials (+ bias) (+ residual)`.
#[allow(clippy::too_many_arguments)]
pub fn launch_skinny_combine<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    problem: &SkinnyProblem,
    plan: &SkinnyPlan,
    partials: ArrayArg<R>,
    bias: ArrayArg<R>,
    residual: ArrayArg<R>,
    out: ArrayArg<R>,
) {
    let column_vectors = problem.n / plan.rhs_vector;
    let total = problem.batch * problem.m * column_vectors;
    let (count, dim) = crate::row::elementwise_geometry(client, total);
    // SAFETY: `partials` holds `splits × total` vectors and `out`/`residual` `total`; units past
    // `total` exit.
    unsafe {
        skinny_combine_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            plan.rhs_vector,
            partials,
            bias,
            residual,
            out,
            plan.splits,
            total,
            column_vectors,
            problem.bias,
            problem.residual,
            dtype,
        )
    }
}
