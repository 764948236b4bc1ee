//! BitNet b1.58 ternary weights with 8-bit activations (W2A8): quantize and pack, dequantize, and
//! the product of a few activation rows with a packed weight (decoding) with integer sums.
//!
//! Layouts (the host definition is `kiln::ops::ternary::format`): a weight row of `k` codes is
//! padded to a multiple of 64 and packed sixteen 2-bit codes `w + 1` a u32 word, code `i` at bit
//! `8 · (i % 4) + 2 · (i / 4)`, so `(word >> 2j) & 0x03030303` holds the codes of elements
//! `4j … 4j+3` as bytes; activations are int8 codes four a word along `k`, padded with zeros to
//! the same 64-element granule. Scales are f32: one per group of output rows (`w ≈ q / s`), one
//! per activation row. A product is `acc / (s_x · s_w)` with the exact integer sum `acc`.
//!
//! The portable GEMV here serves every runtime; on CUDA [`dp4a`] runs the same product with
//! the byte dot-product instruction, which CubeCL's IR does not have.

#[cfg(feature = "cuda")]
pub mod dp4a;
#[cfg(feature = "cuda")]
pub mod wgmma;

use cubecl::prelude::*;

use crate::row::{RowLayout, plane_size_for_reduction, prev_power_of_two, row_index, row_max, row_sum};

/// Codes in a packed weight word.
pub const CODES_PER_WORD: usize = 16;
/// Rows are padded to multiples of this many elements.
pub const ROW_GRANULE: usize = 64;

/// Packed words of a weight row of `k` codes: `k` padded to [`ROW_GRANULE`], sixteen codes a word.
pub(crate) fn weight_row_words(k: usize) -> usize {
    k.div_ceil(ROW_GRANULE) * ROW_GRANULE / CODES_PER_WORD
}

/// The most activation rows the GEMVs take; more go through the GEMM path.
pub const GEMV_MAX_ROWS: usize = 8;
/// The bindings of a product on quantized activations (the CUDA kernels' `dp4a` GEMV and Hopper
/// GEMM): packed activations `[rows, k]` with their f32 scales and code sums, the packed weight
/// `[n, k]` with its group scales, and the dense output `[rows, n]`.
#[cfg(feature = "cuda")]
pub struct PackedArgs {
    pub x: cubecl::server::Binding,
    pub x_scales: cubecl::server::Binding,
    pub x_sums: cubecl::server::Binding,
    pub words: cubecl::server::Binding,
    pub w_scales: cubecl::server::Binding,
    pub out: cubecl::server::Binding,
}

/// The longest rows whose integer sums the kernels carry exactly through f32 reductions and
/// GEMM accumulators (`127 · k < 2²⁴`).
pub const MAX_K: usize = 1 << 17;

/// Bit offset of code `i` (0..16) in its word.
#[cube]
fn code_shift(i: u32) -> u32 {
    8 * (i % 4) + 2 * (i / 4)
}

/// `x` rounded half to even (CUDA's `rint`, WGSL's `round`) and clamped to `[lo, hi]`.
#[cube]
fn round_clamp(x: f32, lo: f32, hi: f32) -> f32 {
    x.round().clamp(lo, hi)
}

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

/// The int8 scale `127 / max(max|x|, 1e-5)` of the row of `vectors` vectors starting at vector
/// `base`, every unit of the row taking part (one row per cube).
#[cube]
fn act_row_scale<F: Float, N: Size>(x: &Array<Vector<F, N>>, base: usize, vectors: usize, #[comptime] layout: RowLayout) -> f32 {
    let mut local = 0.0f32;
    let mut j = UNIT_POS_X as usize;
    while j < vectors {
        let v = Vector::<f32, N>::cast_from(x[base + j]);
        #[unroll]
        for e in 0..N::value() {
            // `a > local` skips a NaN (whose code is 0 anyway).
            let a = v[e].abs();
            local = select(a > local, a, local);
        }
        j += layout.units_per_row;
    }
    let abs_max = row_max(local, layout);
    127.0f32 / abs_max.max(1e-5f32)
}

/// The int8 code of `x` under scale `s`, as a float.
#[cube]
fn act_code(x: f32, s: f32) -> f32 {
    round_clamp(x * s, -128.0, 127.0)
}

/// One layout row per activation row: its scale, its int8 codes packed four a word, and the
/// row's code sum (f32, exact below [`MAX_K`]) for the CUDA kernels' `w + 1` codes. Each unit
/// holds quads `i · units_per_row + UNIT_POS_X` of the row (16 codes each: `per_quad` loads of `N`
/// values, `layout.vectors_per_unit` quads) in registers, so the row is read from memory once:
/// the scale from their maximum, then the codes, one 16-byte store a quad (`W` is 4, a quad).
/// Reading the row twice with a whole cube per row held 512 × 4096 rows at 7–12 µs and 8192 ×
/// 4096 at ~130 µs on the H100, ~0.75 TB/s (`benches/RESULTS.md`, thirty-seventh session).
/// `tiled` writes the quads as [`ActCodes::Tiled`] lays them out (`rows` rows in all).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_acts_packed_kernel<F: Float, N: Size, W: Size>(
    x: &Array<Vector<F, N>>,
    words: &mut Array<Vector<u32, W>>,
    scales: &mut Array<f32>,
    sums: &mut Array<f32>,
    k: usize,
    row_quads: usize,
    rows: usize,
    #[comptime] per_quad: usize,
    #[comptime] tiled: bool,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(layout);
    let valid = row < rows;
    let vectors = k / N::value();
    let base = row * vectors;
    let mut held = Array::<Vector<F, N>>::new(comptime!(layout.vectors_per_unit * per_quad));
    let mut local = 0.0f32;
    #[unroll]
    for i in 0..layout.vectors_per_unit {
        let q = i * layout.units_per_row + UNIT_POS_X as usize;
        #[unroll]
        for vi in 0..per_quad {
            let v = q * per_quad + vi;
            let mut value = Vector::<F, N>::cast_from(Vector::<f32, N>::new(0.0));
            if valid && v < vectors {
                value = x[base + v];
            }
            held[i * per_quad + vi] = value;
            let values = Vector::<f32, N>::cast_from(value);
            #[unroll]
            for e in 0..N::value() {
                // `a > local` skips a NaN (whose code is 0 anyway).
                let a = values[e].abs();
                local = select(a > local, a, local);
            }
        }
    }
    let s = 127.0f32 / row_max(local, layout).max(1e-5f32);
    let mut sum = 0.0f32;
    #[unroll]
    for i in 0..layout.vectors_per_unit {
        let q = i * layout.units_per_row + UNIT_POS_X as usize;
        if valid && q < row_quads {
            let mut quad = Vector::<u32, W>::new(0u32);
            #[unroll]
            for vi in 0..per_quad {
                let values = Vector::<f32, N>::cast_from(held[i * per_quad + vi]);
                #[unroll]
                for e in 0..N::value() {
                    let c = act_code(values[e], s);
                    sum += c;
                    let at = vi * N::value() + e;
                    quad[at / 4] |= (u32::cast_from(i32::cast_from(c)) & 0xff) << ((8 * (at % 4)) as u32);
                }
            }
            let mut index = row * row_quads + q;
            if tiled {
                // 8 quads (128 codes) a block, blocks outermost; quad c of a block at c ^ (row % 8).
                index = ((q / 8) * rows + row) * 8 + ((q % 8) ^ (row % 8));
            }
            words[index] = quad;
        }
    }
    let total = row_sum(sum, layout);
    if valid && UNIT_POS_X == 0 {
        scales[row] = s;
        sums[row] = total;
    }
}

/// One cube per activation row: its scale and its int8 codes as floats in `F` (for a GEMM), or
/// with `dequantized` the values `q / s` they stand for; `N` values a load and store (`N`
/// divides `k`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_acts_float_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    codes: &mut Array<Vector<F, N>>,
    scales: &mut Array<f32>,
    k: usize,
    #[comptime] dequantized: bool,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(layout);
    let vectors = k / N::value();
    let base = row * vectors;
    let s = act_row_scale(x, base, vectors, layout);
    let mut j = UNIT_POS_X as usize;
    while j < vectors {
        let values = Vector::<f32, N>::cast_from(x[base + j]);
        let mut out = Vector::<f32, N>::new(0.0);
        #[unroll]
        for e in 0..N::value() {
            out[e] = act_code(values[e], s);
            if comptime!(dequantized) {
                out[e] /= s;
            }
        }
        codes[base + j] = Vector::cast_from(out);
        j += layout.units_per_row;
    }
    if UNIT_POS_X == 0 {
        scales[row] = s;
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

/// One unit per output: `acc / (s_x[row] · s_w[col / group])` in `F`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rescale_kernel<F: Float>(acc: &Array<i32>, x_scales: &Array<f32>, w_scales: &Array<f32>, out: &mut Array<F>, n: usize, group: usize, len: usize, #[define(F)] _dtype: StorageType) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let row = i / n;
    let col = i % n;
    out[i] = F::cast_from(f32::cast_from(acc[i]) / (x_scales[row] * w_scales[col / group]));
}

/// Sign-extended byte `b` (0..4) of `word`.
#[cube]
fn signed_byte(word: u32, #[comptime] b: u32) -> i32 {
    i32::cast_from(word << comptime!(24 - 8 * b)) >> 24
}

/// `out[r, f] = Σ_k q_x[r, k] · q_w[f, k] / (s_x[r] · s_w[f])` for `rows` activation rows: one
/// layout row per output feature, its units striding over the row's 16-byte vectors of words
/// (64 codes), each word's four groups of four codes against one 16-byte vector of activations
/// per activation row. Sums are exact integers, reduced as f32 (exact below [`MAX_K`]).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gemv_kernel<F: Float, N: Size>(
    x: &Array<Vector<u32, N>>,
    x_scales: &Array<f32>,
    words: &Array<Vector<u32, N>>,
    w_scales: &Array<f32>,
    out: &mut Array<F>,
    n: usize,
    row_vectors: usize,
    group: usize,
    #[comptime] rows: usize,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let feature = row_index(layout);
    let valid = feature < n;
    let mut acc = Array::<i32>::new(rows);
    #[unroll]
    for r in 0..rows {
        acc[r] = 0;
    }
    if valid {
        let mut v = UNIT_POS_X as usize;
        while v < row_vectors {
            let packed = words[feature * row_vectors + v];
            #[unroll]
            for wi in 0..4usize {
                let word = packed[wi];
                #[unroll]
                for r in 0..rows {
                    let a = x[(r * row_vectors + v) * 4 + wi];
                    let mut partial = 0i32;
                    #[unroll]
                    for j in 0..4u32 {
                        let codes = (word >> (2 * j)) & 0x0303_0303u32;
                        #[unroll]
                        for b in 0..4u32 {
                            let q = i32::cast_from((codes >> (8 * b)) & 3) - 1;
                            partial += q * signed_byte(a[j as usize], b);
                        }
                    }
                    acc[r] += partial;
                }
            }
            v += layout.units_per_row;
        }
    }
    #[unroll]
    for r in 0..rows {
        let total = row_sum(f32::cast_from(acc[r]), layout);
        if valid && UNIT_POS_X == 0 {
            out[r * n + feature] = F::cast_from(total / (x_scales[r] * w_scales[feature / group]));
        }
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

/// The layout of the float codes kernel and the weight-scale kernels: one row (or group) per
/// cube, up to 256 units striding over it. A single
/// row (decoding) is one cube whose time is latency, not bandwidth: 5 µs on the H100 for a row of
/// 3200 at 256 units, 6.2 µs at 1024 (`benches/RESULTS.md`, twenty-third session); on CUDA the
/// GEMV of one row does this itself (`dp4a::launch_gemv_fused`).
fn act_layout<R: Runtime>(client: &ComputeClient<R>) -> RowLayout {
    let hardware = &client.properties().hardware;
    let max_units = (hardware.max_units_per_cube as usize).min(hardware.max_cube_dim.0 as usize).min(256);
    RowLayout { units_per_row: prev_power_of_two(max_units.max(1)), rows_per_cube: 1, vectors_per_unit: 1, plane_size: plane_size_for_reduction(client) }
}

/// Quads (16 codes) a unit of [`quantize_acts_packed_kernel`] holds in registers: 4 are eight
/// 16-byte loads of bf16 in flight a unit, 32 registers of values.
const ACT_QUADS_PER_UNIT: usize = 4;

/// The packed activation kernel's grid, cube and layout for `m` rows of `row_quads` quads: units
/// of a row holding [`ACT_QUADS_PER_UNIT`] quads each, rows of a cube filling ~256 units.
fn quad_geometry<R: Runtime>(client: &ComputeClient<R>, m: usize, row_quads: usize) -> (CubeCount, CubeDim, RowLayout) {
    let layout = RowLayout::new(client, row_quads, 16, ACT_QUADS_PER_UNIT).unwrap_or_else(|e| panic!("kiln ternary activation codes: a row of {} codes is too wide (at most {})", e.width, e.max));
    (layout.cube_count(client, m), layout.cube_dim(), layout)
}

/// Codes of an activation row in one block of [`ActCodes::Tiled`].
pub const TILE_BLOCK: usize = 128;

/// Where the activation codes go: packed words with their rows' code sums, or float codes.
pub enum ActCodes<R: Runtime> {
    /// `words` `[m, row_words]` (row_words = `k` padded to 64, over 4), `sums` `[m]` f32.
    Packed { words: ArrayArg<R>, sums: ArrayArg<R> },
    /// As `Packed`, the words `[k / 128 (rounded up), m, 32]`: each row's blocks of
    /// [`TILE_BLOCK`] codes, block-major, with the row's 16-byte chunk `c` at `c ^ (row % 8)`,
    /// so one bulk copy stages a block of consecutive rows as the Hopper GEMM's 128-byte-swizzled
    /// tile (`wgmma::launch_gemm`).
    Tiled { words: ArrayArg<R>, sums: ArrayArg<R> },
    /// `[m, k]` in the input's dtype.
    Float(ArrayArg<R>),
    /// The quantized values `q / s` `[m, k]` in the input's dtype (the f32 quotient rounded
    /// once), as a float GEMM takes the activations for the latent weight's gradient.
    Dequantized(ArrayArg<R>),
}

/// Quantize `m` activation rows of `k` values: per-row scales into `scales` and the codes.
pub fn launch_quantize_acts<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, m: usize, k: usize, x: ArrayArg<R>, scales: ArrayArg<R>, codes: ActCodes<R>) {
    if m == 0 {
        return;
    }
    // Loads of up to 16 bytes; `N` divides `k`, so a row is whole vectors.
    let vector = crate::row::vector_size_for(client, k, dtype.size(), 16);
    // SAFETY: `x` is `[m, k]`, `scales` `[m]`, the codes sized as `ActCodes` documents; every
    // index stays below `k` or the row's words, and rows past `m` (of the packed kernel's last
    // cube) read and write nothing.
    let dequantized = matches!(codes, ActCodes::Dequantized(_));
    unsafe {
        match codes {
            ActCodes::Packed { words, sums } => {
                let row_quads = k.div_ceil(ROW_GRANULE) * ROW_GRANULE / 16;
                let (count, dim, layout) = quad_geometry(client, m, row_quads);
                quantize_acts_packed_kernel::launch_unchecked::<R>(client, count, dim, vector, 4, x, words, scales, sums, k, row_quads, m, 16 / vector, false, layout, dtype)
            }
            ActCodes::Tiled { words, sums } => {
                let row_quads = k.div_ceil(TILE_BLOCK) * TILE_BLOCK / 16;
                let (count, dim, layout) = quad_geometry(client, m, row_quads);
                quantize_acts_packed_kernel::launch_unchecked::<R>(client, count, dim, vector, 4, x, words, scales, sums, k, row_quads, m, 16 / vector, true, layout, dtype)
            }
            ActCodes::Float(codes) | ActCodes::Dequantized(codes) => {
                // One cube per row: the grid has exactly `m` cubes.
                let layout = act_layout(client);
                let (count, dim) = (CubeCount::Static(m as u32, 1, 1), layout.cube_dim());
                quantize_acts_float_kernel::launch_unchecked::<R>(client, count, dim, vector, x, codes, scales, k, dequantized, layout, dtype)
            }
        }
    }
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

/// `out [rows, n] = acc / (s_x · s_w)` for packed activations `x` (`[rows, k]` as words) and a
/// packed weight `[n, k]`, `rows` in `1..=GEMV_MAX_ROWS`.
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    rows: usize,
    n: usize,
    k: usize,
    group: usize,
    x: ArrayArg<R>,
    x_scales: ArrayArg<R>,
    words: ArrayArg<R>,
    w_scales: ArrayArg<R>,
    out: ArrayArg<R>,
) {
    assert!((1..=GEMV_MAX_ROWS).contains(&rows) && k <= MAX_K, "kiln ternary gemv: {rows} rows of {k} features");
    let row_vectors = k.div_ceil(ROW_GRANULE);
    let layout = RowLayout::new(client, row_vectors, 4, 2).expect("a row of 16-byte vectors fits a row layout");
    // SAFETY: `x` holds `rows · row_vectors · 4` vectors of four words, `words` `n · row_vectors`,
    // `out` `rows · n`; features past `n` load and store nothing.
    unsafe {
        gemv_kernel::launch_unchecked::<R>(
            client,
            layout.cube_count(client, n),
            layout.cube_dim(),
            4,
            x,
            x_scales,
            words,
            w_scales,
            out,
            n,
            row_vectors,
            group,
            rows,
            layout,
            dtype,
        )
    }
}

/// The packed weight's codes as an int8 matrix `[n, padded k]` in `out` (`4 · total_words` words).
pub fn launch_unpack_i8<R: Runtime>(client: &ComputeClient<R>, total_words: usize, words: ArrayArg<R>, out: ArrayArg<R>) {
    let (count, dim) = crate::row::elementwise_geometry(client, total_words);
    // SAFETY: `words` has `total_words` words and `out` four times as many; units past the end exit.
    unsafe { unpack_i8_kernel::launch_unchecked::<R>(client, count, dim, words, out, total_words) }
}

/// `out [m, n] = acc / (s_x · s_w)` in `dtype` from integer sums `acc [m, n]`.
#[allow(clippy::too_many_arguments)]
pub fn launch_rescale<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    m: usize,
    n: usize,
    group: usize,
    acc: ArrayArg<R>,
    x_scales: ArrayArg<R>,
    w_scales: ArrayArg<R>,
    out: ArrayArg<R>,
) {
    let len = m * n;
    let (count, dim) = crate::row::elementwise_geometry(client, len);
    // SAFETY: `acc` and `out` hold `m · n` values, the scales `m` and one per group; units past
    // the end exit.
    unsafe { rescale_kernel::launch_unchecked::<R>(client, count, dim, acc, x_scales, w_scales, out, n, group, len, dtype) }
}
