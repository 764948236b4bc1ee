//! Trit kernels that map word pairs to word pairs: conversion from and to integer trits, seeded
//! generation, bind, cyclic permutation and bundling.

use cubecl::prelude::*;

use super::{TRITS_PER_WORD, mix32, valid_bits};
use crate::row::elementwise_geometry;

/// One unit per word pair: the signs of 32 integer trits into the two planes.
#[cube(launch_unchecked)]
fn pack_kernel<I: Int>(trits: &Array<I>, words: &mut Array<u32>, len: usize, pairs: usize, total: usize, #[define(I)] _dtype: StorageType) {
    let pos = ABSOLUTE_POS;
    if pos >= total {
        terminate!();
    }
    let (row, w) = (pos / pairs, pos % pairs);
    let mut plus = 0u32;
    let mut minus = 0u32;
    #[unroll]
    for j in 0..TRITS_PER_WORD {
        let i = w * TRITS_PER_WORD + j;
        if i < len {
            let t = trits[row * len + i];
            plus |= select(t > I::new(0), 1u32, 0u32) << j as u32;
            minus |= select(t < I::new(0), 1u32, 0u32) << j as u32;
        }
    }
    words[2 * pos] = plus;
    words[2 * pos + 1] = minus;
}

/// One unit per trit: `plus bit − minus bit` as an integer.
#[cube(launch_unchecked)]
fn unpack_kernel<I: Int>(words: &Array<u32>, trits: &mut Array<I>, len: usize, pairs: usize, total: usize, #[define(I)] _dtype: StorageType) {
    let pos = ABSOLUTE_POS;
    if pos >= total {
        terminate!();
    }
    let (row, i) = (pos / len, pos % len);
    let pair = row * pairs + i / TRITS_PER_WORD;
    let bit = (i % TRITS_PER_WORD) as u32;
    let t = ((words[2 * pair] >> bit) & 1u32) as i32 - ((words[2 * pair + 1] >> bit) & 1u32) as i32;
    trits[pos] = I::cast_from(t);
}

/// One unit per word pair of a seeded random batch (the host's `random_pair`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn random_kernel(words: &mut Array<u32>, len: usize, pairs: usize, total: usize, seed_low: u32, seed_high: u32, threshold: u32, first_row: u32) {
    let pos = ABSOLUTE_POS;
    if pos >= total {
        terminate!();
    }
    let (row, w) = (pos / pairs, pos % pairs);
    let mut plus = 0u32;
    let mut minus = 0u32;
    #[unroll]
    for j in 0..TRITS_PER_WORD {
        let i = (w * TRITS_PER_WORD + j) as u32;
        let h = mix32(seed_low ^ mix32(seed_high ^ mix32((row as u32 + first_row) ^ mix32(i))));
        let nonzero = h <= threshold;
        let negative = (mix32(h) & 1u32) == 1u32;
        plus |= select(nonzero && !negative, 1u32, 0u32) << j as u32;
        minus |= select(nonzero && negative, 1u32, 0u32) << j as u32;
    }
    let valid = valid_bits(len, w);
    words[2 * pos] = plus & valid;
    words[2 * pos + 1] = minus & valid;
}

/// One unit per vector of words (`N` even: whole pairs): the elementwise product of `a` and `b`,
/// where `b` repeats every `b_vectors` vectors (one row bound to every row of `a`).
#[cube(launch_unchecked)]
fn bind_kernel<N: Size>(
    a: &Array<Vector<u32, N>>,
    b: &Array<Vector<u32, N>>,
    out: &mut Array<Vector<u32, N>>,
    total: usize,
    b_vectors: usize,
    #[comptime] pairs_per_vector: usize,
) {
    let pos = ABSOLUTE_POS;
    if pos >= total {
        terminate!();
    }
    let (x, y) = (a[pos], b[pos % b_vectors]);
    let mut r = Vector::<u32, N>::empty();
    #[unroll]
    for p in 0..pairs_per_vector {
        let (ap, am, bp, bm) = (x[2 * p], x[2 * p + 1], y[2 * p], y[2 * p + 1]);
        r[2 * p] = (ap & bp) | (am & bm);
        r[2 * p + 1] = (ap & bm) | (am & bp);
    }
    out[pos] = r;
}

/// `count` (≤ 32) bits of one plane of `row` from trit `start` on, low bits first; bits past the
/// row read as zero.
#[cube]
fn field(words: &Array<u32>, base: usize, plane: usize, pairs: usize, start: usize, count: usize) -> u32 {
    let (w, shift) = (start / TRITS_PER_WORD, (start % TRITS_PER_WORD) as u32);
    let mut bits = words[base + 2 * w + plane] >> shift;
    if shift > 0 && w + 1 < pairs {
        bits |= words[base + 2 * (w + 1) + plane] << (32u32 - shift);
    }
    if count < TRITS_PER_WORD {
        bits &= (1u32 << count as u32) - 1u32;
    }
    bits
}

/// 32 bits of one plane read from trit `start` on, wrapping at `len`.
#[cube]
fn rotated_field(words: &Array<u32>, base: usize, plane: usize, pairs: usize, len: usize, start: usize) -> u32 {
    let taken = len - start;
    let mut bits = field(words, base, plane, pairs, start, taken.min(TRITS_PER_WORD));
    if taken < TRITS_PER_WORD {
        bits |= field(words, base, plane, pairs, 0, (TRITS_PER_WORD - taken).min(len)) << taken as u32;
    }
    bits
}

/// One unit per output word pair: element `i` moves to `(i + shift) mod len` (`shift < len`).
#[cube(launch_unchecked)]
fn permute_kernel(words: &Array<u32>, out: &mut Array<u32>, len: usize, pairs: usize, total: usize, shift: usize) {
    let pos = ABSOLUTE_POS;
    if pos >= total {
        terminate!();
    }
    let (row, w) = (pos / pairs, pos % pairs);
    let base = row * pairs * 2;
    let start = (w * TRITS_PER_WORD + len - shift) % len;
    let valid = valid_bits(len, w);
    out[2 * pos] = rotated_field(words, base, 0, pairs, len, start) & valid;
    out[2 * pos + 1] = rotated_field(words, base, 1, pairs, len, start) & valid;
}

/// Units over `(word pair, chunk of rows)`: the weighted sum of each of the pair's 32 trits over
/// the chunk's rows, into `sums[chunk][32 · pair + j]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn bundle_sum_kernel(
    words: &Array<u32>,
    weights: &Array<i32>,
    sums: &mut Array<i32>,
    rows: usize,
    pairs: usize,
    rows_per_chunk: usize,
    #[comptime] weighted: bool,
) {
    let w = ABSOLUTE_POS_X as usize;
    let chunk = ABSOLUTE_POS_Y as usize;
    if w >= pairs {
        terminate!();
    }
    let mut counts = Array::<i32>::new(TRITS_PER_WORD);
    #[unroll]
    for j in 0..TRITS_PER_WORD {
        counts[j] = 0;
    }
    let first = chunk * rows_per_chunk;
    let last = (first + rows_per_chunk).min(rows);
    for row in first..last {
        let (plus, minus) = (words[2 * (row * pairs + w)], words[2 * (row * pairs + w) + 1]);
        let mut weight = 1i32;
        if comptime!(weighted) {
            weight = weights[row];
        }
        #[unroll]
        for j in 0..TRITS_PER_WORD {
            let t = ((plus >> j as u32) & 1u32) as i32 - ((minus >> j as u32) & 1u32) as i32;
            counts[j] += weight * t;
        }
    }
    #[unroll]
    for j in 0..TRITS_PER_WORD {
        sums[(chunk * pairs + w) * TRITS_PER_WORD + j] = counts[j];
    }
}

/// Units per cube of the sign pass: 8 word pairs of 32 trits.
const SIGN_UNITS: usize = 8 * TRITS_PER_WORD;

/// One unit per trit: the sign of its sums over the chunks (0 on a tie), then one unit per word
/// pair gathers its 32 signs into the planes through shared memory.
#[cube(launch_unchecked)]
fn bundle_sign_kernel(sums: &Array<i32>, out: &mut Array<u32>, pairs: usize, chunks: usize) {
    let mut plus_bits = SharedMemory::<u32>::new(SIGN_UNITS);
    let mut minus_bits = SharedMemory::<u32>::new(SIGN_UNITS);
    let unit = UNIT_POS as usize;
    let (w, j) = (CUBE_POS * comptime!(SIGN_UNITS / TRITS_PER_WORD) + unit / TRITS_PER_WORD, unit % TRITS_PER_WORD);
    let valid = w < pairs;
    let mut total = 0i32;
    if valid {
        for chunk in 0..chunks {
            total += sums[(chunk * pairs + w) * TRITS_PER_WORD + j];
        }
    }
    plus_bits[unit] = select(total > 0, 1u32, 0u32) << j as u32;
    minus_bits[unit] = select(total < 0, 1u32, 0u32) << j as u32;
    sync_cube();
    if valid && j == 0 {
        let mut plus = 0u32;
        let mut minus = 0u32;
        #[unroll]
        for t in 0..TRITS_PER_WORD {
            plus |= plus_bits[unit + t];
            minus |= minus_bits[unit + t];
        }
        out[2 * w] = plus;
        out[2 * w + 1] = minus;
    }
}

/// The low 16 bits of `x` moved to the even bit positions.
#[cube]
fn spread_even(x: u32) -> u32 {
    let mut y = x & 0xffffu32;
    y = (y | (y << 8u32)) & 0x00ff_00ffu32;
    y = (y | (y << 4u32)) & 0x0f0f_0f0fu32;
    y = (y | (y << 2u32)) & 0x3333_3333u32;
    (y | (y << 1u32)) & 0x5555_5555u32
}

/// One unit per word pair: its 32 trits as two words of 2-bit codes
/// ([`super::WordLayout::Codes`]).
#[cube(launch_unchecked)]
fn planes_to_codes_kernel(words: &Array<u32>, codes: &mut Array<u32>, total: usize) {
    let pos = ABSOLUTE_POS;
    if pos >= total {
        terminate!();
    }
    let (plus, minus) = (words[2 * pos], words[2 * pos + 1]);
    codes[2 * pos] = spread_even(plus) | (spread_even(minus) << 1u32);
    codes[2 * pos + 1] = spread_even(plus >> 16u32) | (spread_even(minus >> 16u32) << 1u32);
}

/// Rewrite `pairs` word pairs as 2-bit codes (the layout measurement of the GPU check).
pub fn launch_planes_to_codes<R: Runtime>(client: &ComputeClient<R>, pairs: usize, words: ArrayArg<R>, codes: ArrayArg<R>) {
    if pairs == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, pairs);
    // SAFETY: both arrays hold `2 · pairs` words; units past `pairs` exit.
    unsafe { planes_to_codes_kernel::launch_unchecked::<R>(client, count, dim, words, codes, pairs) }
}

/// Pack `rows × len` integer trits (signs taken) into `rows × pairs` word pairs.
pub fn launch_pack<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, rows: usize, len: usize, trits: ArrayArg<R>, words: ArrayArg<R>) {
    let pairs = len.div_ceil(TRITS_PER_WORD);
    let total = rows * pairs;
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: `trits` holds `rows × len` values, `words` `2 · total`; units past `total` exit and
    // every trit index is checked against `len`.
    unsafe { pack_kernel::launch_unchecked::<R>(client, count, dim, trits, words, len, pairs, total, dtype) }
}

/// Unpack `rows` rows of word pairs into `rows × len` integer trits of `dtype`.
pub fn launch_unpack<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, rows: usize, len: usize, words: ArrayArg<R>, trits: ArrayArg<R>) {
    let total = rows * len;
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: `trits` holds `total` values, `words` `rows × 2⌈len/32⌉`; units past `total` exit.
    unsafe { unpack_kernel::launch_unchecked::<R>(client, count, dim, words, trits, len, len.div_ceil(TRITS_PER_WORD), total, dtype) }
}

/// Rows `first_row …` of the seeded random batch of `len` trits (`threshold` from the density).
#[allow(clippy::too_many_arguments)]
pub fn launch_random<R: Runtime>(client: &ComputeClient<R>, rows: usize, len: usize, seed: u64, threshold: u32, first_row: u32, words: ArrayArg<R>) {
    let pairs = len.div_ceil(TRITS_PER_WORD);
    let total = rows * pairs;
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: `words` holds `2 · total` words; units past `total` exit.
    unsafe {
        random_kernel::launch_unchecked::<R>(client, count, dim, words, len, pairs, total, seed as u32, (seed >> 32) as u32, threshold, first_row)
    }
}

/// Bind `a` (`words` words) with `b` (`b_words` words, repeated over `a`), both multiples of
/// `vector_size`, which is even.
pub fn launch_bind<R: Runtime>(client: &ComputeClient<R>, words: usize, b_words: usize, vector_size: usize, a: ArrayArg<R>, b: ArrayArg<R>, out: ArrayArg<R>) {
    let total = words / vector_size;
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: `a` and `out` hold `total` vectors, `b` `b_words / vector_size` (its index wraps);
    // units past `total` exit.
    unsafe { bind_kernel::launch_unchecked::<R>(client, count, dim, vector_size, a, b, out, total, b_words / vector_size, vector_size / 2) }
}

/// Permute `rows` rows of `len ≥ 1` trits by `shift < len`.
pub fn launch_permute<R: Runtime>(client: &ComputeClient<R>, rows: usize, len: usize, shift: usize, words: ArrayArg<R>, out: ArrayArg<R>) {
    let pairs = len.div_ceil(TRITS_PER_WORD);
    let total = rows * pairs;
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: `words` and `out` hold `2 · total` words; units past `total` exit; every read is
    // inside its row (`field` checks the next pair).
    unsafe { permute_kernel::launch_unchecked::<R>(client, count, dim, words, out, len, pairs, total, shift) }
}

/// Arguments of a bundle: `rows` rows of `pairs` word pairs into one row.
pub struct BundleArgs<R: Runtime> {
    pub words: ArrayArg<R>,
    /// `rows` i32 weights, read when `weighted` (any binding otherwise).
    pub weights: ArrayArg<R>,
    pub weighted: bool,
    /// `chunks × pairs × 32` i32 scratch ([`BundleArgs::chunks`]), bound twice: written by the
    /// first pass, read by the second.
    pub sums: (ArrayArg<R>, ArrayArg<R>),
    pub out: ArrayArg<R>,
}

impl<R: Runtime> BundleArgs<R> {
    /// Row chunks the first pass splits `rows` into (each unit sums one pair over one chunk).
    pub fn chunks(client: &ComputeClient<R>, rows: usize, pairs: usize) -> usize {
        // About 2048 units a multiprocessor over the first pass, each summing at least 16 rows.
        let units_wanted = 2048 * client.properties().hardware.num_streaming_multiprocessors.unwrap_or(16) as usize;
        units_wanted.div_ceil(pairs.max(1)).clamp(1, rows.div_ceil(16).max(1))
    }
}

/// `sign(Σ wᵢ · rowᵢ)` per trit over `rows ≥ 1` rows of `pairs` pairs.
pub fn launch_bundle<R: Runtime>(client: &ComputeClient<R>, rows: usize, pairs: usize, args: BundleArgs<R>) {
    if pairs == 0 {
        return;
    }
    let chunks = BundleArgs::<R>::chunks(client, rows, pairs);
    let rows_per_chunk = rows.div_ceil(chunks);
    let dim = CubeDim::new_1d(64);
    let count = CubeCount::Static(pairs.div_ceil(64) as u32, chunks as u32, 1);
    // SAFETY: units past `pairs` exit; chunk `c` reads rows `[c · rows_per_chunk, rows)` only and
    // writes its own `pairs × 32` sums.
    unsafe { bundle_sum_kernel::launch_unchecked::<R>(client, count, dim, args.words, args.weights, args.sums.0, rows, pairs, rows_per_chunk, args.weighted) }
    let dim = CubeDim::new_1d(SIGN_UNITS as u32);
    let count = cubecl::calculate_cube_count_elemwise(client, pairs * TRITS_PER_WORD, dim);
    // SAFETY: `sums` holds `chunks × pairs × 32` values, `out` `2 · pairs`; units of pairs past
    // `pairs` read nothing and write nothing (they only join the barrier).
    unsafe { bundle_sign_kernel::launch_unchecked::<R>(client, count, dim, args.sums.1, args.out, pairs, chunks) }
}
