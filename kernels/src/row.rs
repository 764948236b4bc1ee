//! Shared machinery for kernels that reduce along the last axis of a `[rows, width]` tensor.
//!
//! A cube holds `rows_per_cube` rows, each handled by `units_per_row` units along the cube's x
//! axis. Every unit keeps its `vectors_per_unit` vectors of the row in registers, so a row is read
//! from global memory once even though it is used twice (statistics, then the normalized write).

use cubecl::prelude::*;

/// Rows each row slot of a grid-stride launch targets ([`RowLayout::grid_stride_cubes`]).
pub const ROWS_PER_SLOT: usize = 8;

/// Compile-time shape of a row kernel launch. Distinct values compile distinct kernels, so the
/// host keeps the set small: it depends only on the row width and the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowLayout {
    /// Units cooperating on one row (a power of two).
    pub units_per_row: usize,
    /// Rows processed by one cube.
    pub rows_per_cube: usize,
    /// Vectors of the row held in registers by each unit.
    pub vectors_per_unit: usize,
    /// Plane (warp) size when the reduction may use plane operations; 0 selects the portable
    /// shared-memory reduction.
    pub plane_size: usize,
}

/// The most vectors one unit keeps in registers. Beyond this the row is too wide for the
/// register-resident design and the launch is refused with a clear error.
pub const MAX_VECTORS_PER_UNIT: usize = 32;

/// Error for a row that does not fit the register-resident kernels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowTooWide {
    pub width: usize,
    pub max: usize,
}

impl RowLayout {
    /// Choose a layout for rows of `width_vectors` vectors on `client`, aiming for
    /// `target_vectors_per_unit` vectors per unit and cubes of about 256 units.
    ///
    /// More vectors per unit put more independent loads in flight; fewer keep the registers a
    /// unit needs low enough for several cubes to share a multiprocessor. Forward kernels hold
    /// one array per row and take 4; backward kernels hold four to six (inputs, gradients, γ,
    /// dγ, …) and take 1, or they spill and run one cube per multiprocessor.
    pub fn new<R: Runtime>(
        client: &ComputeClient<R>,
        width_vectors: usize,
        vector_size: usize,
        target_vectors_per_unit: usize,
    ) -> Result<Self, RowTooWide> {
        let max_units = max_units(client);
        let layout = Self::with_units(client, width_vectors, target_vectors_per_unit, max_units);
        if layout.vectors_per_unit > MAX_VECTORS_PER_UNIT {
            return Err(RowTooWide {
                width: width_vectors * vector_size,
                max: max_units * MAX_VECTORS_PER_UNIT * vector_size,
            });
        }
        Ok(layout)
    }

    /// A layout for kernels that stream their rows instead of holding them (cross-entropy over a
    /// vocabulary): as [`RowLayout::new`], but at most one cube of units a row and no width limit, each
    /// unit looping over its `vectors_per_unit` vectors.
    pub fn streaming<R: Runtime>(client: &ComputeClient<R>, width_vectors: usize, target_vectors_per_unit: usize) -> Self {
        Self::with_units(client, width_vectors, target_vectors_per_unit, max_units(client).min(TARGET_UNITS_PER_CUBE))
    }

    /// About `target_vectors_per_unit` vectors a unit, at most `max_units` units a row (a power of
    /// two), rows filling cubes of about [`TARGET_UNITS_PER_CUBE`] units.
    fn with_units<R: Runtime>(client: &ComputeClient<R>, width_vectors: usize, target_vectors_per_unit: usize, max_units: usize) -> Self {
        let width_vectors = width_vectors.max(1);
        let units_per_row = width_vectors
            .div_ceil(target_vectors_per_unit.max(1))
            .next_power_of_two()
            .min(max_units);
        let rows_per_cube = (TARGET_UNITS_PER_CUBE / units_per_row)
            .clamp(1, client.properties().hardware.max_cube_dim.1 as usize)
            .min(max_units / units_per_row)
            .max(1);
        Self {
            units_per_row,
            rows_per_cube,
            vectors_per_unit: width_vectors.div_ceil(units_per_row),
            plane_size: plane_size_for_reduction(client),
        }
    }

    /// Cube dimension: x spans the units of a row, y the rows of a cube.
    pub fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(self.units_per_row as u32, self.rows_per_cube as u32)
    }

    /// Cubes for a grid-stride launch over `rows` rows: enough that each row slot of a cube
    /// takes [`ROWS_PER_SLOT`] rows (at least one cube a multiprocessor where there are rows for
    /// it), at most as many as the multiprocessors hold at once (2048 units each). Each slot
    /// writes one row of partial sums (dγ) that a second launch adds up, so filling the device
    /// with slots made those partials as large as the activations: for 4096 rows of 2048,
    /// RMSNorm's backward wrote 17 MB of them and Burn's sum took 24–30 µs to add them, about
    /// half of a norm's backward (`benches/RESULTS.md`, fortieth session). `KILN_ROWS_PER_SLOT` overrides the target
    /// for measurements.
    pub fn grid_stride_cubes<R: Runtime>(&self, client: &ComputeClient<R>, rows: usize) -> usize {
        const UNITS_PER_MULTIPROCESSOR: usize = 2048;
        let sms = client
            .properties()
            .hardware
            .num_streaming_multiprocessors
            .unwrap_or(64) as usize;
        let units_per_cube = self.units_per_row * self.rows_per_cube;
        let resident = sms * (UNITS_PER_MULTIPROCESSOR / units_per_cube).max(1);
        let per_slot = crate::measurement_override("KILN_ROWS_PER_SLOT", 1..=1024).unwrap_or(ROWS_PER_SLOT);
        let slots = rows.div_ceil(self.rows_per_cube);
        slots.div_ceil(per_slot).max(slots.min(sms)).clamp(1, resident)
    }

    /// Trip count of the grid-stride loop of `cubes` cubes over `rows` rows.
    pub fn grid_stride_iterations(&self, rows: usize, cubes: usize) -> usize {
        rows.div_ceil(cubes * self.rows_per_cube)
    }

    /// Rows of the f32 partial-sum buffer that `cubes` grid-stride cubes write (one per row slot).
    pub fn partial_rows(&self, cubes: usize) -> usize {
        cubes * self.rows_per_cube
    }

    /// Enough cubes to cover `rows` rows. The count may overshoot, so kernels bound-check rows.
    pub fn cube_count<R: Runtime>(&self, client: &ComputeClient<R>, rows: usize) -> CubeCount {
        let cubes = rows.div_ceil(self.rows_per_cube).max(1);
        cubecl::calculate_cube_count_elemwise(client, cubes, CubeDim::new_single())
    }
}

/// Units a cube aims for.
const TARGET_UNITS_PER_CUBE: usize = 256;

/// The most units a row may take on `client`'s device: a power of two, at most 1024.
fn max_units<R: Runtime>(client: &ComputeClient<R>) -> usize {
    let hw = &client.properties().hardware;
    let units = (hw.max_units_per_cube as usize).min(hw.max_cube_dim.0 as usize).min(1024);
    prev_power_of_two(units.max(1))
}

/// The plane size to reduce with, or 0 when plane operations are unavailable or the plane size
/// is not fixed (the butterfly below needs it at compile time).
pub(crate) fn plane_size_for_reduction<R: Runtime>(client: &ComputeClient<R>) -> usize {
    let props = client.properties();
    let hw = &props.hardware;
    let fixed = hw.plane_size_min == hw.plane_size_max && hw.plane_size_max.is_power_of_two();
    if fixed && props.features.plane.contains(cubecl::ir::features::Plane::Ops) {
        hw.plane_size_max as usize
    } else {
        0
    }
}

/// The largest power of two not above `n` (`n` ≥ 1).
pub(crate) fn prev_power_of_two(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// Index of the row this unit works on, counted over the whole launch.
#[cube]
pub fn row_index(#[comptime] layout: RowLayout) -> usize {
    CUBE_POS * layout.rows_per_cube + UNIT_POS_Y as usize
}

/// Sum `value` over the units of this unit's row; every unit of the row gets the total.
///
/// Every unit of the cube must call this (it may synchronize the cube), including units whose
/// row is out of range: they pass 0.
#[cube]
pub fn row_sum(value: f32, #[comptime] layout: RowLayout) -> f32 {
    row_reduce(value, layout, false)
}

/// Maximum of `value` over the units of this unit's row, under the same contract as [`row_sum`]
/// (units with nothing to contribute pass a very negative value).
#[cube]
pub fn row_max(value: f32, #[comptime] layout: RowLayout) -> f32 {
    row_reduce(value, layout, true)
}

#[cube]
fn combine(a: f32, b: f32, #[comptime] max: bool) -> f32 {
    if comptime!(max) { a.max(b) } else { a + b }
}

/// The reduction behind [`row_sum`] and [`row_max`]: a lane butterfly when the row fits in a
/// plane, plane reductions plus shared memory when it spans planes, a shared-memory tree without
/// plane operations. The shared-memory paths end with a barrier so that the next call (in a
/// loop) cannot overwrite values a slower unit is still reading.
#[cube]
fn row_reduce(value: f32, #[comptime] layout: RowLayout, #[comptime] max: bool) -> f32 {
    let units = layout.units_per_row;
    let plane = layout.plane_size;
    if comptime!(plane > 0 && units <= plane) {
        // Butterfly inside aligned groups of `units` lanes: rows never mix.
        let mut total = value;
        #[unroll]
        for step in 0..comptime!(units.trailing_zeros()) {
            total = combine(total, plane_shuffle_xor(total, 1u32 << step), max);
        }
        total
    } else if comptime!(plane > 0) {
        let planes_per_row = comptime!(units / plane);
        let mut partials = SharedMemory::<f32>::new(comptime!(planes_per_row * layout.rows_per_cube));
        let base = UNIT_POS_Y as usize * planes_per_row;
        let in_plane = if comptime!(max) { plane_max(value) } else { plane_sum(value) };
        if UNIT_POS_PLANE == 0 {
            partials[base + UNIT_POS_X as usize / plane] = in_plane;
        }
        sync_cube();
        let mut total = partials[base];
        #[unroll]
        for p in 1..planes_per_row {
            total = combine(total, partials[base + p], max);
        }
        sync_cube();
        total
    } else {
        let mut scratch = SharedMemory::<f32>::new(comptime!(units * layout.rows_per_cube));
        let base = UNIT_POS_Y as usize * units;
        let x = UNIT_POS_X as usize;
        scratch[base + x] = value;
        sync_cube();
        #[unroll]
        for step in 0..comptime!(units.trailing_zeros()) {
            let stride = units >> (step + 1);
            if x < stride {
                scratch[base + x] = combine(scratch[base + x], scratch[base + x + stride], max);
            }
            sync_cube();
        }
        let total = scratch[base];
        sync_cube();
        total
    }
}

/// Largest vector width (in elements) that divides `width`, keeps loads within `max_bytes`, and
/// is offered by the device for elements of `elem_size` bytes.
pub fn vector_size_for<R: Runtime>(
    client: &ComputeClient<R>,
    width: usize,
    elem_size: usize,
    max_bytes: usize,
) -> usize {
    client
        .io_optimized_vector_sizes(elem_size)
        .filter(|&v| v * elem_size <= max_bytes && width % v == 0)
        .max()
        .unwrap_or(1)
}

/// Cube geometry for a plain elementwise kernel over `units` work items.
pub fn elementwise_geometry<R: Runtime>(client: &ComputeClient<R>, units: usize) -> (CubeCount, CubeDim) {
    let cube_dim = CubeDim::new(client, units);
    let cube_count = cubecl::calculate_cube_count_elemwise(client, units, cube_dim);
    (cube_count, cube_dim)
}

/// Column vectors a cube of [`launch_sum_partials`] adds up, side by side along x.
const SUM_COLUMNS: usize = 4;
/// Units a column's partial rows are dealt to, along y; their sums meet in shared memory.
const SUM_LANES: usize = 64;
/// Rows a lane loads before adding any of them, so that several loads are in flight a unit.
const SUM_UNROLL: usize = 4;

/// `out[c] = Σ_r partials[r, c]` in `out`'s dtype, for the f32 partial sums that the row kernels'
/// backward write one row per slot (dγ, DoRA's dm). Lane `l` of a column adds rows `l`, `l + 64`,
/// … (four loads in flight), then the lanes' sums meet by halving in shared memory, so the result
/// does not depend on scheduling.
#[cube(launch_unchecked)]
fn sum_partials_kernel<G: Float, N: Size>(
    partials: &Array<Vector<f32, N>>,
    out: &mut Array<Vector<G, N>>,
    rows: usize,
    width_vectors: usize,
    #[define(G)] _dtype: StorageType,
) {
    let x = UNIT_POS_X as usize;
    let lane = UNIT_POS_Y as usize;
    let col = CUBE_POS * SUM_COLUMNS + x;
    let mut total = Vector::<f32, N>::new(0.0);
    if col < width_vectors {
        let mut row = lane;
        while row < rows {
            let mut loaded = Array::<Vector<f32, N>>::new(SUM_UNROLL);
            #[unroll]
            for u in 0..SUM_UNROLL {
                let at = row + u * SUM_LANES;
                loaded[u] = Vector::new(0.0);
                if at < rows {
                    loaded[u] = partials[at * width_vectors + col];
                }
            }
            #[unroll]
            for u in 0..SUM_UNROLL {
                total += loaded[u];
            }
            row += SUM_LANES * SUM_UNROLL;
        }
    }
    let mut lanes = SharedMemory::<Vector<f32, N>>::new(comptime!(SUM_COLUMNS * SUM_LANES));
    lanes[lane * SUM_COLUMNS + x] = total;
    sync_cube();
    #[unroll]
    for step in 0..comptime!(SUM_LANES.trailing_zeros()) {
        let half = SUM_LANES >> (step + 1);
        if lane < half {
            lanes[lane * SUM_COLUMNS + x] = lanes[lane * SUM_COLUMNS + x] + lanes[(lane + half) * SUM_COLUMNS + x];
        }
        sync_cube();
    }
    if lane == 0 && col < width_vectors {
        out[col] = Vector::cast_from(lanes[x]);
    }
}

/// Launch [`sum_partials_kernel`] over `[rows, width]` f32 partial sums into `width` values of
/// `dtype`. One launch instead of Burn's sum along rows and a cast: that pair took 15–30 µs for a
/// norm's few MB of partials, about half of the norm's backward (`benches/RESULTS.md`, fortieth
/// and forty-fourth sessions).
pub fn launch_sum_partials<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    rows: usize,
    width: usize,
    partials: ArrayArg<R>,
    out: ArrayArg<R>,
) {
    let vector_size = vector_size_for(client, width, 4, 16);
    let width_vectors = width / vector_size;
    if width_vectors == 0 {
        return;
    }
    let cubes = width_vectors.div_ceil(SUM_COLUMNS) as u32;
    // SAFETY: `partials` holds `rows × width` f32 values and `out` `width` values of `dtype`, both
    // contiguous; `vector_size` divides `width`, and the kernel bound-checks columns and rows.
    unsafe {
        sum_partials_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_2d(SUM_COLUMNS as u32, SUM_LANES as u32),
            vector_size,
            partials,
            out,
            rows,
            width_vectors,
            dtype,
        )
    }
}

/// Sum of the lanes of a vector.
#[cube]
pub fn lane_sum<N: Size>(v: Vector<f32, N>) -> f32 {
    let mut total = 0.0f32;
    #[unroll]
    for i in 0..N::value() {
        total += v[i];
    }
    total
}
