//! The activation side of W2A8: each row's int8 codes under its absmax scale, packed four a word
//! (for the integer kernels, in rows or in the Hopper GEMM's tiles) or as floats (for a float
//! GEMM, or the values they stand for, for the latent weight's gradient).

use cubecl::prelude::*;

use super::{ROW_GRANULE, round_clamp};
use crate::row::{RowLayout, lane_sum, row_index, row_max, row_sum};

/// `local` raised to the largest `|v|` of `v`; `a > local` skips a NaN (whose code is 0 anyway).
#[cube]
fn abs_max<N: Size>(local: f32, v: Vector<f32, N>) -> f32 {
    let mut m = local;
    #[unroll]
    for e in 0..N::value() {
        let a = v[e].abs();
        m = select(a > m, a, m);
    }
    m
}

/// The int8 scale `127 / max(max|x|, 1e-5)` from the units' partial maxima of a row (every unit
/// of the row taking part).
#[cube]
fn act_scale(local: f32, #[comptime] layout: RowLayout) -> f32 {
    127.0f32 / row_max(local, layout).max(1e-5f32)
}

/// A row's `1 / sqrt(mean(x²) + ε)` from its units' partial sums of squares (every unit of the
/// row taking part), as the RMSNorm kernel computes it.
#[cube]
fn row_rstd(squares: f32, k: usize, epsilon: f32, #[comptime] layout: RowLayout) -> f32 {
    (row_sum(squares, layout) / f32::cast_from(k) + epsilon).inverse_sqrt()
}

/// `x · rstd · γ` in f32, rounded once to `F`: the value `rms_norm` writes.
#[cube]
fn normalized<F: Float, N: Size>(x: Vector<F, N>, gamma: Vector<F, N>, rstd: f32) -> Vector<F, N> {
    Vector::cast_from(Vector::<f32, N>::cast_from(x) * Vector::new(rstd) * Vector::<f32, N>::cast_from(gamma))
}

/// The row vector in held slot `h` of a unit of the activation kernels ([`hold_row`]): slot `h` holds
/// load `h % per_quad` of the unit's quad `h / per_quad`, quads striding by the row's units.
#[cube]
fn held_vector(h: usize, #[comptime] per_quad: usize, #[comptime] layout: RowLayout) -> usize {
    ((h / per_quad) * layout.units_per_row + UNIT_POS_X as usize) * per_quad + h % per_quad
}

/// The int8 code of `x` under scale `s`, as a float.
#[cube]
fn act_code(x: f32, s: f32) -> f32 {
    round_clamp(x * s, -128.0, 127.0)
}

/// `q / s` from the row's correctly rounded `inv = 1 / s`: the product and one fused correction
/// by the exact remainder (Markstein), which rounds the quotient as IEEE division does where the
/// backend fuses `fma` (CUDA; WGSL may not, leaving it within an ulp). With IEEE division
/// the QAT backward's kernel ran with 17–24 of 32 lanes active and at 15–18% of DRAM bandwidth,
/// divergent as the division's slow path is (the packed kernel, the same code without it, keeps
/// all 32); this took it from 4.65 to 2.47 ms a QAT step (`benches/RESULTS.md`, 46th session).
#[cube]
fn quotient(q: f32, s: f32, inv: f32) -> f32 {
    let y = q * inv;
    fma(fma(-y, s, q), inv, y)
}

/// This unit's quads of activation row `row` into `held` (each unit holds quads
/// `i · units_per_row + UNIT_POS_X`, `per_quad` loads of `N` values each; zeros past the row),
/// RMS-normalized first with `normed` ([`ActNorm`]; the row's `rstd` written unless `given`),
/// returning the row's int8 scale. Every unit of the cube must call this: it reduces over the row.
#[cube]
#[allow(clippy::too_many_arguments)]
fn hold_row<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    gamma: &Array<Vector<F, N>>,
    rstd: &mut Array<f32>,
    held: &mut Array<Vector<F, N>>,
    row: usize,
    valid: bool,
    k: usize,
    epsilon: f32,
    #[comptime] per_quad: usize,
    #[comptime] normed: bool,
    #[comptime] given: bool,
    #[comptime] layout: RowLayout,
) -> f32 {
    let vectors = k / N::value();
    let base = row * vectors;
    let mut squares = 0.0f32;
    #[unroll]
    for h in 0..comptime!(layout.vectors_per_unit * per_quad) {
        let v = held_vector(h, per_quad, layout);
        let mut value = Vector::<F, N>::cast_from(Vector::<f32, N>::new(0.0));
        if valid && v < vectors {
            value = x[base + v];
        }
        held[h] = value;
        if comptime!(normed && !given) {
            let f = Vector::<f32, N>::cast_from(value);
            squares += lane_sum(f * f);
        }
    }
    if comptime!(normed) {
        let mut r = 0.0f32;
        if comptime!(given) {
            if valid {
                r = rstd[row];
            }
        } else {
            r = row_rstd(squares, k, epsilon, layout);
            if valid && UNIT_POS_X == 0 {
                rstd[row] = r;
            }
        }
        #[unroll]
        for h in 0..comptime!(layout.vectors_per_unit * per_quad) {
            let v = held_vector(h, per_quad, layout);
            if valid && v < vectors {
                held[h] = normalized(held[h], gamma[v], r);
            }
        }
    }
    let mut local = 0.0f32;
    #[unroll]
    for i in 0..comptime!(layout.vectors_per_unit * per_quad) {
        local = abs_max(local, Vector::<f32, N>::cast_from(held[i]));
    }
    act_scale(local, layout)
}

/// One layout row per activation row: its scale, its int8 codes packed four a word, and the
/// row's code sum (f32, exact below [`MAX_K`](super::MAX_K)) for the CUDA kernels' `w + 1`
/// codes. Each unit holds quads `i · units_per_row + UNIT_POS_X` of the row (16 codes each:
/// `per_quad` loads of `N` values, `layout.vectors_per_unit` quads) in registers, so the row is
/// read from memory once: the scale from their maximum, then the codes, one 16-byte store a quad
/// (`W` is 4, a quad). Reading the row twice with a whole cube per row held 512 × 4096 rows at
/// 7–12 µs and 8192 × 4096 at ~130 µs on the H100, ~0.75 TB/s (`benches/RESULTS.md`,
/// thirty-seventh session). `tiled` writes the quads as [`ActCodes::Tiled`] lays them out
/// (`rows` rows in all). With `normed` the held row is first replaced by its RMSNorm output
/// ([`ActNorm`]), so BitLinear's input norm costs no pass over memory of its own.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_acts_packed_kernel<F: Float, N: Size, W: Size>(
    x: &Array<Vector<F, N>>,
    gamma: &Array<Vector<F, N>>,
    words: &mut Array<Vector<u32, W>>,
    scales: &mut Array<f32>,
    sums: &mut Array<f32>,
    rstd: &mut Array<f32>,
    k: usize,
    row_quads: usize,
    rows: usize,
    epsilon: f32,
    #[comptime] per_quad: usize,
    #[comptime] tiled: bool,
    #[comptime] normed: bool,
    #[comptime] given: bool,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(layout);
    let valid = row < rows;
    let mut held = Array::<Vector<F, N>>::new(comptime!(layout.vectors_per_unit * per_quad));
    let s = hold_row(x, gamma, rstd, &mut held, row, valid, k, epsilon, per_quad, normed, given, layout);
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

/// One layout row per activation row: its scale and its int8 codes as floats in `F` (for a
/// GEMM), or with `dequantized` the values `q / s` they stand for (the f32 quotient rounded once),
/// the row held in registers as [`quantize_acts_packed_kernel`] holds it, so it is read once. A
/// whole cube a row reading it twice (for the scale, then the codes) took 32 µs a call for the QAT
/// step's weight gradients, 115 calls a step (H100, `benches/RESULTS.md`, forty-first session).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_acts_float_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    gamma: &Array<Vector<F, N>>,
    codes: &mut Array<Vector<F, N>>,
    scales: &mut Array<f32>,
    rstd: &mut Array<f32>,
    k: usize,
    rows: usize,
    epsilon: f32,
    #[comptime] per_quad: usize,
    #[comptime] dequantized: bool,
    #[comptime] normed: bool,
    #[comptime] given: bool,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(layout);
    let valid = row < rows;
    let mut held = Array::<Vector<F, N>>::new(comptime!(layout.vectors_per_unit * per_quad));
    let s = hold_row(x, gamma, rstd, &mut held, row, valid, k, epsilon, per_quad, normed, given, layout);
    let mut inv = 0.0f32;
    if comptime!(dequantized) {
        inv = 1.0f32 / s;
    }
    let vectors = k / N::value();
    #[unroll]
    for h in 0..comptime!(layout.vectors_per_unit * per_quad) {
        let v = held_vector(h, per_quad, layout);
        if valid && v < vectors {
            let values = Vector::<f32, N>::cast_from(held[h]);
            let mut out = Vector::<f32, N>::new(0.0);
            #[unroll]
            for e in 0..N::value() {
                out[e] = act_code(values[e], s);
                if comptime!(dequantized) {
                    out[e] = quotient(out[e], s, inv);
                }
            }
            codes[row * vectors + v] = Vector::cast_from(out);
        }
    }
    if valid && UNIT_POS_X == 0 {
        scales[row] = s;
    }
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

/// An RMSNorm applied to each activation row before it is quantized (BitLinear's input norm):
/// the row becomes `x · rstd · γ` rounded once to the input's dtype, `rstd = 1 / sqrt(mean(x²) +
/// ε)` in f32, exactly the values `rms_norm` would write, without writing them.
pub enum ActNorm<R: Runtime> {
    /// `γ [k]` in the input's dtype; the kernel computes each row's `rstd` into `rstd` `[m]` f32
    /// (the forward, which saves it for the backward).
    Compute { gamma: ArrayArg<R>, rstd: ArrayArg<R>, epsilon: f32 },
    /// `γ [k]` with the rows' `rstd` `[m]` given (the backward recomputing the forward's values).
    Given { gamma: ArrayArg<R>, rstd: ArrayArg<R> },
}

/// The kernels' norm arguments `(γ, rstd, ε, normed, given)`. Without a norm two 16-byte scratch
/// buffers, which the kernels then never touch, stand in for `γ` and `rstd`.
fn norm_args<R: Runtime>(client: &ComputeClient<R>, norm: Option<ActNorm<R>>) -> (ArrayArg<R>, ArrayArg<R>, f32, bool, bool) {
    match norm {
        Some(ActNorm::Compute { gamma, rstd, epsilon }) => (gamma, rstd, epsilon, true, false),
        Some(ActNorm::Given { gamma, rstd }) => (gamma, rstd, 0.0, true, true),
        // SAFETY: unread and unwritten without a norm.
        None => unsafe { (ArrayArg::from_raw_parts(client.empty(16), 1), ArrayArg::from_raw_parts(client.empty(16), 1), 0.0, false, false) },
    }
}

/// Quantize `m` activation rows of `k` values, RMS-normalized first with `norm`: per-row scales
/// into `scales` and the codes.
#[allow(clippy::too_many_arguments)]
pub fn launch_quantize_acts<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, m: usize, k: usize, x: ArrayArg<R>, scales: ArrayArg<R>, codes: ActCodes<R>, norm: Option<ActNorm<R>>) {
    if m == 0 {
        return;
    }
    // Loads of up to 16 bytes; `N` divides `k`, so a row is whole vectors.
    let vector = crate::row::vector_size_for(client, k, dtype.size(), 16);
    let (gamma, rstd, epsilon, normed, given) = norm_args(client, norm);
    // SAFETY: `x` is `[m, k]`, `scales` `[m]`, the codes sized as `ActCodes` documents, a norm's
    // `γ` `[k]` and `rstd` `[m]`; every index stays below `k` or the row's words, and rows past
    // `m` (of the last cube) read and write nothing.
    let dequantized = matches!(codes, ActCodes::Dequantized(_));
    let tiled = matches!(codes, ActCodes::Tiled { .. });
    unsafe {
        match codes {
            ActCodes::Packed { words, sums } | ActCodes::Tiled { words, sums } => {
                let block = if tiled { TILE_BLOCK } else { ROW_GRANULE };
                let row_quads = k.div_ceil(block) * block / 16;
                let (count, dim, layout) = quad_geometry(client, m, row_quads);
                quantize_acts_packed_kernel::launch_unchecked::<R>(client, count, dim, vector, 4, x, gamma, words, scales, sums, rstd, k, row_quads, m, epsilon, 16 / vector, tiled, normed, given, layout, dtype)
            }
            ActCodes::Float(codes) | ActCodes::Dequantized(codes) => {
                let (count, dim, layout) = quad_geometry(client, m, k.div_ceil(16));
                quantize_acts_float_kernel::launch_unchecked::<R>(client, count, dim, vector, x, gamma, codes, scales, rstd, k, m, epsilon, 16 / vector, dequantized, normed, given, layout, dtype)
            }
        }
    }
}
