//! The weight side of W2A8: BitNet's absmean scales of a float weight (computed on the device in
//! the weight's own dtype), quantizing and packing it into 2-bit codes, dequantizing, and
//! unpacking the codes to int8 for an integer GEMM.

use cubecl::prelude::*;

use super::{CODES_PER_WORD, act_layout, code_shift, round_clamp, weight_row_words};
use crate::row::{RowLayout, row_index, row_sum};

/// One unit per packed word: sixteen codes `clamp(round(w · s), −1, 1) + 1` of one weight row,
/// `s` the row's group scale; columns past `k` hold the padding code 1.
#[cube(launch_unchecked)]
fn quantize_weight_kernel<F: Float>(
    weight: &Array<F>,
    scales: &Array<f32>,
    words: &mut Array<u32>,
    k: usize,
    row_words: usize,
    group: usize,
    total_words: usize,
    #[define(F)] _dtype: StorageType,
) {
    let w = ABSOLUTE_POS;
    if w >= total_words {
        terminate!();
    }
    let row = w / row_words;
    let first = (w % row_words) * CODES_PER_WORD;
    let s = scales[row / group];
    let mut word = 0u32;
    #[unroll]
    for i in 0..CODES_PER_WORD {
        let j = first + i;
        let mut code = 1u32;
        if j < k {
            code = u32::cast_from(round_clamp(f32::cast_from(weight[row * k + j]) * s, -1.0, 1.0) + 1.0);
        }
        word |= code << code_shift(i as u32);
    }
    words[w] = word;
}

/// Each weight row's `Σ|w|` in f32, `N` values a load (`N` divides `k`): the first pass of the
/// absmean scales, read in the weight's own dtype. One row per cube, its units striding along it
/// (grid rows past `n` only join the reduction).
#[cube(launch_unchecked)]
fn weight_abs_sums_kernel<F: Float, N: Size>(weight: &Array<Vector<F, N>>, sums: &mut Array<f32>, n: usize, k: usize, #[comptime] layout: RowLayout, #[define(F)] _dtype: StorageType) {
    let row = row_index(layout);
    let vectors = k / N::value();
    let mut local = 0.0f32;
    if row < n {
        let base = row * vectors;
        let mut j = UNIT_POS_X as usize;
        while j < vectors {
            let v = Vector::<f32, N>::cast_from(weight[base + j]);
            #[unroll]
            for e in 0..N::value() {
                local += v[e].abs();
            }
            j += layout.units_per_row;
        }
    }
    let total = row_sum(local, layout);
    if row < n && UNIT_POS_X == 0 {
        sums[row] = total;
    }
}

/// Each group's scale `1 / max(mean|w|, ε)` from its rows' sums (the last group may be short):
/// one group per cube, its units striding over the group's rows.
#[cube(launch_unchecked)]
fn weight_group_scales_kernel(row_sums: &Array<f32>, scales: &mut Array<f32>, n: usize, k: usize, group: usize, epsilon: f32, #[comptime] layout: RowLayout) {
    let g = row_index(layout);
    let first = g * group;
    let mut rows = 0;
    if first < n {
        rows = group.min(n - first);
    }
    let mut local = 0.0f32;
    let mut r = UNIT_POS_X as usize;
    while r < rows {
        local += row_sums[first + r];
        r += layout.units_per_row;
    }
    let total = row_sum(local, layout);
    if rows > 0 && UNIT_POS_X == 0 {
        scales[g] = 1.0f32 / (total / f32::cast_from(rows * k)).max(epsilon);
    }
}

/// Codes a unit of the dequantize kernel writes: half a packed word.
const DEQUANTIZE_CODES: usize = 8;
/// Units of a dequantize cube (along a row) and rows of its grid's y axis.
const DEQUANTIZE_UNITS: u32 = 128;
const DEQUANTIZE_GRID_ROWS: usize = 32768;

/// One unit per eight codes of a weight row: the codes `q` (`unscaled`) or `q / s`, in `F`, stored
/// `N` values a store (`N` divides `k` and 8). The row's scale is inverted once and the codes
/// multiplied by it (`q · (1/s)` is `q / s` for `q ∈ {−1, 0, 1}`), and rows come from the grid's y
/// and z, so no value pays a division. One unit a value with three divisions took ~1.1 ms for
/// 28672 × 8192 on the H100; one unit per eight values stored one at a time still ~1 ms on the
/// H200 (eight 2-byte stores a sector; thirty-fourth session). A cube's x runs along the row.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dequantize_kernel<F: Float, N: Size>(
    words: &Array<u32>,
    scales: &Array<f32>,
    out: &mut Array<Vector<F, N>>,
    n: usize,
    k: usize,
    row_words: usize,
    group: usize,
    #[comptime] unscaled: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = (CUBE_POS_Z * CUBE_COUNT_Y + CUBE_POS_Y) as usize;
    let j0 = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize * DEQUANTIZE_CODES;
    if row >= n || j0 >= k {
        terminate!();
    }
    let word = words[row * row_words + j0 / CODES_PER_WORD];
    let first = (j0 % CODES_PER_WORD) as u32;
    let mut inverse = 1.0f32;
    if comptime!(!unscaled) {
        inverse = 1.0f32 / scales[row / group];
    }
    let base = row * k + j0;
    // Vector `v` of the unit's eight values, for as many as there are (the bound is a constant
    // for unrolling; `N` is at least 1).
    #[unroll]
    for v in 0..DEQUANTIZE_CODES {
        let first_value = v * N::value();
        // `N` divides `k`: a vector lies wholly inside the row or wholly past it.
        if first_value < DEQUANTIZE_CODES && j0 + first_value < k {
            let mut values = Vector::<f32, N>::new(0.0);
            #[unroll]
            for e in 0..N::value() {
                let i = first_value + e;
                values[e] = (f32::cast_from((word >> code_shift(first + i as u32)) & 3) - 1.0) * inverse;
            }
            out[(base + first_value) / N::value()] = Vector::cast_from(values);
        }
    }
}

/// One unit per packed weight word: its sixteen codes as int8 `w` (four words of four bytes, the
/// row-major `[n, padded k]` i8 matrix an integer GEMM reads). Bytes `c + 0x7f` never borrow
/// across bytes (`c ≤ 2`), and flipping their top bit leaves `c − 1`.
#[cube(launch_unchecked)]
fn unpack_i8_kernel(words: &Array<u32>, out: &mut Array<u32>, total_words: usize) {
    let w = ABSOLUTE_POS;
    if w >= total_words {
        terminate!();
    }
    let word = words[w];
    #[unroll]
    for j in 0..4u32 {
        let codes = (word >> (2 * j)) & 0x0303_0303u32;
        out[w * 4 + j as usize] = ((codes | 0x8080_8080u32) - 0x0101_0101u32) ^ 0x8080_8080u32;
    }
}

/// BitNet's absmean scales of a row-major float weight `[n, k]`: `scales[g] = 1 / max(mean |w|, ε)`
/// over each group of `group` output rows, the sums in f32 (`row_sums`: scratch of `n` f32s,
/// written by the first launch, read by the second). Two small launches that read the weight
/// once in its own dtype.
#[allow(clippy::too_many_arguments)]
pub fn launch_weight_scales<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, n: usize, k: usize, group: usize, epsilon: f32, weight: ArrayArg<R>, row_sums: &cubecl::server::Handle, scales: ArrayArg<R>) {
    if n == 0 {
        return;
    }
    let vector = crate::row::vector_size_for(client, k, dtype.size(), 16);
    let layout = act_layout(client);
    // SAFETY: `weight` is `[n, k]` and `N` divides `k`; `row_sums` holds `n` f32s and `scales`
    // one per group; rows and groups past the end only join their cube's reduction.
    unsafe {
        let sums = || ArrayArg::from_raw_parts(row_sums.clone(), n);
        weight_abs_sums_kernel::launch_unchecked::<R>(client, layout.cube_count(client, n), layout.cube_dim(), vector, weight, sums(), n, k, layout, dtype);
        weight_group_scales_kernel::launch_unchecked::<R>(client, layout.cube_count(client, n.div_ceil(group)), layout.cube_dim(), sums(), scales, n, k, group, epsilon, layout);
    }
}

/// Pack a row-major float weight `[n, k]` with per-group scales `scales` (one per `group` rows)
/// into `words` (`n · row_words`, `row_words` = `k` padded to 64, over 16).
#[allow(clippy::too_many_arguments)]
pub fn launch_quantize_weight<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    k: usize,
    row_words: usize,
    group: usize,
    total_words: usize,
    weight: ArrayArg<R>,
    scales: ArrayArg<R>,
    words: ArrayArg<R>,
) {
    let (count, dim) = crate::row::elementwise_geometry(client, total_words);
    // SAFETY: `weight` is `[n, k]`, `scales` has one value per group, `words` `total_words`;
    // units past the last word exit.
    unsafe { quantize_weight_kernel::launch_unchecked::<R>(client, count, dim, weight, scales, words, k, row_words, group, total_words, dtype) }
}

/// Dequantize a packed weight `[n, k]` into `out` (`q`, or `q / s` unless `unscaled`).
#[allow(clippy::too_many_arguments)]
pub fn launch_dequantize<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    n: usize,
    k: usize,
    group: usize,
    unscaled: bool,
    words: ArrayArg<R>,
    scales: ArrayArg<R>,
    out: ArrayArg<R>,
) {
    let row_words = weight_row_words(k);
    let units = k.div_ceil(DEQUANTIZE_CODES);
    let cube_units = (units.next_multiple_of(32) as u32).min(DEQUANTIZE_UNITS);
    let grid_rows = n.min(DEQUANTIZE_GRID_ROWS);
    let count = CubeCount::Static(units.div_ceil(cube_units as usize) as u32, grid_rows as u32, n.div_ceil(grid_rows) as u32);
    // Stores of up to 16 bytes, at most a unit's eight values; `N` divides `k`.
    let vector = crate::row::vector_size_for(client, k, dtype.size(), 16).min(DEQUANTIZE_CODES);
    // SAFETY: `words` holds `n · row_words` words, `scales` one per group, `out` `n · k`; units
    // past a row's end or rows past `n` exit.
    unsafe { dequantize_kernel::launch_unchecked::<R>(client, count, CubeDim::new_1d(cube_units), vector, words, scales, out, n, k, row_words, group, unscaled, dtype) }
}

/// The packed weight's codes as an int8 matrix `[n, padded k]` in `out` (`4 · total_words` words).
pub fn launch_unpack_i8<R: Runtime>(client: &ComputeClient<R>, total_words: usize, words: ArrayArg<R>, out: ArrayArg<R>) {
    let (count, dim) = crate::row::elementwise_geometry(client, total_words);
    // SAFETY: `words` has `total_words` words and `out` four times as many; units past the end exit.
    unsafe { unpack_i8_kernel::launch_unchecked::<R>(client, count, dim, words, out, total_words) }
}
