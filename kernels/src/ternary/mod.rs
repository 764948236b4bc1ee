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

mod acts;
#[cfg(feature = "cuda")]
pub mod dp4a;
mod weight;
#[cfg(feature = "cuda")]
pub mod wgmma;

pub use acts::{ActCodes, ActNorm, TILE_BLOCK, launch_quantize_acts};
pub use weight::{launch_dequantize, launch_quantize_weight, launch_unpack_i8, launch_weight_scales};

use cubecl::prelude::*;

use crate::row::{RowLayout, plane_size_for_reduction, prev_power_of_two, row_index, row_sum};

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

/// The layout of the weight-scale kernels: one row (or group) per cube, up to 256 units striding
/// over it.
fn act_layout<R: Runtime>(client: &ComputeClient<R>) -> RowLayout {
    let hardware = &client.properties().hardware;
    let max_units = (hardware.max_units_per_cube as usize).min(hardware.max_cube_dim.0 as usize).min(256);
    RowLayout { units_per_row: prev_power_of_two(max_units.max(1)), rows_per_cube: 1, vectors_per_unit: 1, plane_size: plane_size_for_reduction(client) }
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
