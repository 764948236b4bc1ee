//! 4-bit weights in bitsandbytes' NF4/FP4 layout: blockwise quantization, dequantization, and the
//! product of a few activation rows with a 4-bit weight (decoding), which dequantizes in registers
//! and never writes the float weight anywhere.
//!
//! Device layout (the host side is `kiln::ops::nf4::format`): the weight `[n, k]` is flattened
//! row-major; codes are packed eight to a little-endian u32 word, element `i` at bit
//! `8 · (i / 2 % 4) + 4 · (1 − i % 2)` of word `i / 8` (bitsandbytes' bytes, first element in the
//! high nibble, read four at a time). Each block of `block` elements has a scale: an f32 absmax,
//! or with double quantization `nested_code[q] · nested_absmax[b / 256] + offset` where `q` is the
//! block's 8-bit code, packed four to a word like the nibbles' bytes.
//!
//! Blocks are multiples of 32 elements, so a word, and a vector of up to four words starting at
//! a multiple of its size, never straddles two blocks.
//!
//! The portable GEMV here serves every runtime; on CUDA [`mma`] runs half-precision products
//! of up to eight rows on the tensor cores, and on Hopper [`wgmma`] the prefill-sized ones.

#[cfg(feature = "cuda")]
pub mod mma;
#[cfg(feature = "cuda")]
pub mod wgmma;

use cubecl::prelude::*;

use crate::row::{RowLayout, row_index, row_max, row_sum};

/// Blocks of the double quantization (bitsandbytes' `quantize_blockwise(blocksize=256)`).
const NESTED_BLOCK: usize = 256;

/// Bit offset of element `j` (0..8) in its word.
#[cube]
fn nibble_shift(j: u32) -> u32 {
    8 * (j / 2) + 4 * (1 - j % 2)
}

/// The scale of block `b`. Nested scales are `code · scale` then `+ offset`, as bitsandbytes
/// computes them; the device compiler may contract that into one fused multiply-add, which can
/// move the scale by an ulp.
#[cube]
fn block_scale(
    b: usize,
    absmax: &Array<f32>,
    absmax_codes: &Array<u32>,
    nested_code: &Array<f32>,
    offset: &Array<f32>,
    #[comptime] nested: bool,
) -> f32 {
    if comptime!(nested) {
        let q = (absmax_codes[b / 4] >> (8 * (b % 4)) as u32) & 0xff;
        nested_code[q as usize] * absmax[b / NESTED_BLOCK] + offset[0]
    } else {
        absmax[b]
    }
}

/// Zero for a subnormal `x` (bitsandbytes' CUDA build flushes them; see `kiln::ops::nf4::format`).
#[cube]
fn flush_subnormal(x: f32) -> f32 {
    select(x.abs() < f32::MIN_POSITIVE, 0.0f32, x)
}

/// The 4-bit code of `x` (already scaled by `1 / absmax`): NF4 counts the ascending thresholds
/// below `x`; FP4 does so for `|x|` over its seven magnitude thresholds, maps the rank to the
/// magnitude code (ranks 2, 3, 6, 7 have bit 2 flipped) and sets bit 3 for negative `x`. A NaN
/// exceeds no threshold and takes code 0, as in bitsandbytes.
#[cube]
fn code_of(x: f32, thresholds: &Array<f32>, #[comptime] fp4: bool) -> u32 {
    let mut rank = 0u32;
    if comptime!(fp4) {
        let a = x.abs();
        #[unroll]
        for t in 0..7usize {
            rank += select(a > thresholds[t], 1u32, 0u32);
        }
        let magnitude = rank ^ ((rank & 2) << 1);
        magnitude | select(x < 0.0, 8u32, 0u32)
    } else {
        #[unroll]
        for t in 0..15usize {
            rank += select(x > thresholds[t], 1u32, 0u32);
        }
        rank
    }
}

/// One row of the layout per block: the units of a row take its words in turn, find the block's
/// absmax together, then write each word's eight codes.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_kernel<F: Float>(
    x: &Array<F>,
    thresholds: &Array<f32>,
    words: &mut Array<u32>,
    absmax: &mut Array<f32>,
    len: usize,
    blocks: usize,
    #[comptime] block: usize,
    #[comptime] fp4: bool,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let b = row_index(layout);
    let valid = b < blocks;
    let words_per_block = comptime!(block / 8);
    let first = b * block;
    let mut local = 0.0f32;
    if valid {
        let mut w = UNIT_POS_X as usize;
        while w < words_per_block {
            #[unroll]
            for j in 0..8usize {
                let i = first + w * 8 + j;
                if i < len {
                    // `v > local` skips a NaN, as `fmaxf` does.
                    let v = f32::cast_from(x[i]).abs();
                    local = select(v > local, v, local);
                }
            }
            w += layout.units_per_row;
        }
    }
    let block_max = row_max(local, layout);
    if valid {
        if UNIT_POS_X == 0 {
            absmax[b] = block_max;
        }
        let recip = flush_subnormal(1.0f32 / block_max);
        let mut w = UNIT_POS_X as usize;
        while w < words_per_block {
            let mut word = 0u32;
            #[unroll]
            for j in 0..8u32 {
                let i = first + w * 8 + j as usize;
                if i < len {
                    word |= code_of(flush_subnormal(f32::cast_from(x[i]) * recip), thresholds, fp4) << nibble_shift(j);
                }
            }
            let index = b * words_per_block + w;
            if index * 8 < len {
                words[index] = word;
            }
            w += layout.units_per_row;
        }
    }
}

/// One unit per word: eight values `code[q] · scale` in the output dtype, stored as one vector of
/// eight (`whole_words`, `N` = 8) where the length allows, else one by one (`N` = 1).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dequantize_kernel<F: Float, N: Size>(
    words: &Array<u32>,
    code: &Array<f32>,
    absmax: &Array<f32>,
    absmax_codes: &Array<u32>,
    nested_code: &Array<f32>,
    offset: &Array<f32>,
    out: &mut Array<Vector<F, N>>,
    len: usize,
    #[comptime] block: usize,
    #[comptime] nested: bool,
    #[comptime] whole_words: bool,
    #[define(F)] _dtype: StorageType,
) {
    let w = ABSOLUTE_POS;
    if w * 8 >= len {
        terminate!();
    }
    let word = words[w];
    let scale = block_scale(w * 8 / block, absmax, absmax_codes, nested_code, offset, nested);
    if comptime!(whole_words) {
        let mut values = Vector::<F, N>::empty();
        #[unroll]
        for j in 0..8u32 {
            values[j as usize] = F::cast_from(code[((word >> nibble_shift(j)) & 15) as usize] * scale);
        }
        out[w] = values;
    } else {
        #[unroll]
        for j in 0..8u32 {
            let i = w * 8 + j as usize;
            if i < len {
                out[i] = Vector::cast_from(F::cast_from(code[((word >> nibble_shift(j)) & 15) as usize] * scale));
            }
        }
    }
}

/// `out[r, n] = Σ_k x[r, k] · W[n, k]` for `rows` activation rows: one layout row per output
/// feature `n`, whose units take `vectors_per_unit` vectors of `W`'s words each (all loads issued
/// before any is used, so a unit keeps several 16-byte loads in flight), keep every activation
/// row's partial sum in registers, then reduce once per activation row. The code book sits in
/// shared memory; each vector of words has one scale, applied to its partial sums.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gemv_kernel<F: Float, NX: Size, NW: Size>(
    x: &Array<Vector<F, NX>>,
    words: &Array<Vector<u32, NW>>,
    code: &Array<f32>,
    absmax: &Array<f32>,
    absmax_codes: &Array<u32>,
    nested_code: &Array<f32>,
    offset: &Array<f32>,
    out: &mut Array<F>,
    n: usize,
    k: usize,
    #[comptime] rows: usize,
    #[comptime] x_per_word: usize,
    #[comptime] block: usize,
    #[comptime] nested: bool,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let mut lut = SharedMemory::<f32>::new(16usize);
    let flat = UNIT_POS as usize;
    if flat < 16 {
        lut[flat] = code[flat];
    }
    sync_cube();

    let feature = row_index(layout);
    let valid = feature < n;
    // Vectors of words in a row; `x_per_word` activation vectors span a word (NX · x_per_word = 8).
    let vectors = k / (8 * NW::value());
    let first_vector = feature * vectors;
    let x_row = k / NX::value();
    let per_unit = layout.vectors_per_unit;

    // Issue every load of this unit's share first: the packed words and their scales.
    let mut packed = Array::<Vector<u32, NW>>::new(per_unit);
    let mut scales = Array::<f32>::new(per_unit);
    #[unroll]
    for i in 0..per_unit {
        let v = i * layout.units_per_row + UNIT_POS_X as usize;
        let live = valid && v < vectors;
        let at = select(live, first_vector + v, 0);
        packed[i] = words[at];
        let element = (first_vector + v) * 8 * NW::value();
        scales[i] = select(live, block_scale(select(live, element / block, 0), absmax, absmax_codes, nested_code, offset, nested), 0.0);
    }

    let mut acc = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        acc[r] = 0.0;
    }
    #[unroll]
    for i in 0..per_unit {
        let v = i * layout.units_per_row + UNIT_POS_X as usize;
        if valid && v < vectors {
            let mut partial = Array::<f32>::new(rows);
            #[unroll]
            for r in 0..rows {
                partial[r] = 0.0;
            }
            #[unroll]
            for wi in 0..NW::value() {
                let word = packed[i][wi];
                let x_first = (v * NW::value() + wi) * x_per_word;
                #[unroll]
                for xv in 0..x_per_word {
                    let mut xs = Array::<Vector<F, NX>>::new(rows);
                    #[unroll]
                    for r in 0..rows {
                        xs[r] = x[r * x_row + x_first + xv];
                    }
                    #[unroll]
                    for e in 0..NX::value() {
                        let j = (xv * NX::value() + e) as u32;
                        let w = lut[((word >> nibble_shift(j)) & 15) as usize];
                        #[unroll]
                        for r in 0..rows {
                            partial[r] = fma(f32::cast_from(xs[r][e]), w, partial[r]);
                        }
                    }
                }
            }
            #[unroll]
            for r in 0..rows {
                acc[r] = fma(partial[r], scales[i], acc[r]);
            }
        }
    }
    #[unroll]
    for r in 0..rows {
        let total = row_sum(acc[r], layout);
        if valid && UNIT_POS_X == 0 {
            out[r * n + feature] = F::cast_from(total);
        }
    }
}

/// Where a 4-bit weight's block scales live, bound as arrays for the kernels. Plain scales bind
/// `absmax` in the three nested slots too (unread).
pub struct ScaleArgs<R: Runtime> {
    pub absmax: ArrayArg<R>,
    pub absmax_codes: ArrayArg<R>,
    pub nested_code: ArrayArg<R>,
    pub offset: ArrayArg<R>,
    pub nested: bool,
}

/// Quantize `len` contiguous values (`len` even) in blocks of `block` (a multiple of 32):
/// `words` receives `⌈len / 8⌉` packed words, `absmax` one f32 per block. `thresholds` holds the
/// type's ascending rounding thresholds (15 for NF4, 7 magnitudes for FP4).
#[allow(clippy::too_many_arguments)]
pub fn launch_quantize<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
    block: usize,
    fp4: bool,
    x: ArrayArg<R>,
    thresholds: ArrayArg<R>,
    words: ArrayArg<R>,
    absmax: ArrayArg<R>,
) {
    let blocks = len.div_ceil(block);
    if blocks == 0 {
        return;
    }
    let layout = RowLayout::new(client, block / 8, 8, 4).expect("a block of at most 4096 values fits a row layout");
    // SAFETY: `x` has `len` elements, `words` ⌈len/8⌉, `absmax` `blocks`; every index is checked
    // against `len`/`blocks`.
    unsafe {
        quantize_kernel::launch_unchecked::<R>(
            client,
            layout.cube_count(client, blocks),
            layout.cube_dim(),
            x,
            thresholds,
            words,
            absmax,
            len,
            blocks,
            block,
            fp4,
            layout,
            dtype,
        )
    }
}

/// Dequantize `len` values into `out` (dtype `dtype`) with the type's 16-entry code book `code`.
#[allow(clippy::too_many_arguments)]
pub fn launch_dequantize<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
    block: usize,
    words: ArrayArg<R>,
    code: ArrayArg<R>,
    scales: ScaleArgs<R>,
    out: ArrayArg<R>,
) {
    let units = len.div_ceil(8);
    if units == 0 {
        return;
    }
    let (count, dim) = crate::row::elementwise_geometry(client, units);
    let vector = if len.is_multiple_of(8) { 8 } else { 1 };
    let ScaleArgs { absmax, absmax_codes, nested_code, offset, nested } = scales;
    // SAFETY: `words` has ⌈len/8⌉ words, `out` `len` elements, the scales one per block; units
    // past the last word exit.
    unsafe {
        dequantize_kernel::launch_unchecked::<R>(
            client, count, dim, vector, words, code, absmax, absmax_codes, nested_code, offset, out, len, block, nested, vector == 8, dtype,
        )
    }
}

/// The most activation rows the portable 4-bit GEMV takes; more go through dequantization and a
/// GEMM (on CUDA, half-precision products of up to `mma::MMA_MAX_ROWS` rows take the
/// tensor-core GEMV first).
/// The GEMV's time grows with the rows (each row's products are its own FMAs and activation
/// loads), dequantize + GEMM's hardly does: on the H100 at 8192 → 28672 the GEMV took 98.5 µs at
/// one row and 568 µs at eight, the dequantize + GEMM route ~360 µs (`benches/RESULTS.md`,
/// 2026-11-25), so they cross near five rows.
pub const GEMV_MAX_ROWS: usize = 4;

/// Whether the GEMV takes a `[rows, k] · [n, k]ᵀ` product: few rows and whole words per row.
pub fn gemv_fits(rows: usize, k: usize) -> bool {
    (1..=GEMV_MAX_ROWS).contains(&rows) && k.is_multiple_of(8) && k > 0
}

/// `out [rows, n] = x [rows, k] · Wᵀ` for a 4-bit `W [n, k]` (see [`gemv_fits`]).
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    rows: usize,
    n: usize,
    k: usize,
    block: usize,
    x: ArrayArg<R>,
    words: ArrayArg<R>,
    code: ArrayArg<R>,
    scales: ScaleArgs<R>,
    out: ArrayArg<R>,
) {
    assert!(gemv_fits(rows, k), "kiln nf4 gemv: {rows} rows of {k} features");
    // Up to four words (32 codes, 16 bytes) a load where rows allow; activations in vectors of
    // up to eight (one word's worth).
    let word_vector = [4, 2, 1].into_iter().find(|v| k.is_multiple_of(8 * v)).unwrap_or(1);
    let x_vector = crate::row::vector_size_for(client, 8, dtype.size(), 16);
    // Four 16-byte loads in flight per unit (`KILN_NF4_GEMV_VECTORS` overrides, for measurements).
    let per_unit = crate::measurement_override("KILN_NF4_GEMV_VECTORS", 1..=16).unwrap_or(4);
    let layout = RowLayout::new(client, k / (8 * word_vector), word_vector, per_unit).expect("a row of words fits a row layout");
    let ScaleArgs { absmax, absmax_codes, nested_code, offset, nested } = scales;
    // SAFETY: `x` is `[rows, k]`, `words` holds `n · k / 8` words, `out` is `[rows, n]`; features
    // past `n` compute nothing and store nothing.
    unsafe {
        gemv_kernel::launch_unchecked::<R>(
            client,
            layout.cube_count(client, n),
            layout.cube_dim(),
            x_vector,
            word_vector,
            x,
            words,
            code,
            absmax,
            absmax_codes,
            nested_code,
            offset,
            out,
            n,
            k,
            rows,
            8 / x_vector,
            block,
            nested,
            layout,
            dtype,
        )
    }
}
