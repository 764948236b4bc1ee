//! The ternary gradient sketch (`kiln::ops::sketch`): compression by a seeded permutation into
//! signed buckets and decompression by the transpose, the permutation recomputed per element
//! (never stored). The host definition (`kiln::ops::sketch::format`) documents the math; these
//! kernels follow it step for step, so results are identical.

use cubecl::prelude::*;

use crate::row::elementwise_geometry;
use crate::trit::mix32;

/// What the host passes for a [`Permutation`] and the signs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SketchParams {
    pub n: usize,
    pub ratio: usize,
    pub half_bits: u32,
    /// Feistel round keys, rounds 0 to 3.
    pub keys: [u32; 4],
    pub seed: u64,
}

/// One Feistel round forward: `(l, r) → (r, l ^ F(r))`.
#[cube]
fn round_forward(x: u32, h: u32, mask: u32, key: u32) -> u32 {
    let (left, right) = (x >> h, x & mask);
    (right << h) | (left ^ (mix32(right ^ key) & mask))
}

/// One Feistel round backward (the inverse of [`round_forward`] with the same key).
#[cube]
fn round_backward(x: u32, h: u32, mask: u32, key: u32) -> u32 {
    let (left, right) = (x >> h, x & mask);
    (right ^ (mix32(left ^ key) & mask)) << h | left
}

/// The whole network, forward or inverse.
#[cube]
fn feistel(x: u32, h: u32, k0: u32, k1: u32, k2: u32, k3: u32, #[comptime] inverse: bool) -> u32 {
    let mask = (1u32 << h) - 1u32;
    let mut y = x;
    if comptime!(inverse) {
        y = round_backward(y, h, mask, k3);
        y = round_backward(y, h, mask, k2);
        y = round_backward(y, h, mask, k1);
        y = round_backward(y, h, mask, k0);
    } else {
        y = round_forward(y, h, mask, k0);
        y = round_forward(y, h, mask, k1);
        y = round_forward(y, h, mask, k2);
        y = round_forward(y, h, mask, k3);
    }
    y
}

/// `π(x)` (or `π⁻¹`) by cycle walking below `n`.
#[cube]
fn permute(x: u32, n: u32, h: u32, k0: u32, k1: u32, k2: u32, k3: u32, #[comptime] inverse: bool) -> u32 {
    let mut y = feistel(x, h, k0, k1, k2, k3, inverse);
    while y >= n {
        y = feistel(y, h, k0, k1, k2, k3, inverse);
    }
    y
}

/// Whether column `j` has sign −1.
#[cube]
fn negative(j: u32, seed_low: u32, seed_high: u32) -> bool {
    (mix32(seed_high ^ mix32(j ^ seed_low)) >> 31u32) == 1u32
}

/// One unit per bucket: the signed sum of its inputs in position order (or the plain sum of
/// their squares for `squares`), in f32.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn compress_kernel<F: Float>(
    g: &Array<F>,
    c: &mut Array<f32>,
    n: u32,
    ratio: u32,
    buckets: u32,
    h: u32,
    k0: u32,
    k1: u32,
    k2: u32,
    k3: u32,
    seed_low: u32,
    seed_high: u32,
    #[comptime] squares: bool,
    #[define(F)] _dtype: StorageType,
) {
    let b = ABSOLUTE_POS as u32;
    if b >= buckets {
        terminate!();
    }
    let mut sum = 0.0f32;
    let first = b * ratio;
    let last = (first + ratio).min(n);
    for p in first..last {
        let j = permute(p, n, h, k0, k1, k2, k3, true);
        let x = f32::cast_from(g[j as usize]);
        if comptime!(squares) {
            sum += x * x;
        } else {
            sum += select(negative(j, seed_low, seed_high), -x, x);
        }
    }
    c[b as usize] = sum;
}

/// One unit per element: its bucket's value, signed (`Pᵀ·c`) or not.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn decompress_kernel<F: Float>(
    c: &Array<f32>,
    out: &mut Array<F>,
    n: u32,
    ratio: u32,
    h: u32,
    k0: u32,
    k1: u32,
    k2: u32,
    k3: u32,
    seed_low: u32,
    seed_high: u32,
    #[comptime] signed: bool,
    #[define(F)] _dtype: StorageType,
) {
    let j = ABSOLUTE_POS as u32;
    if j >= n {
        terminate!();
    }
    let v = c[(permute(j, n, h, k0, k1, k2, k3, false) / ratio) as usize];
    let mut value = v;
    if comptime!(signed) {
        value = select(negative(j, seed_low, seed_high), -v, v);
    }
    out[j as usize] = F::cast_from(value);
}

/// Compress `g` (`n` values of `dtype`) into `⌈n / ratio⌉` f32 bucket sums: signed, or of the
/// squares (unsigned) with `squares`.
pub fn launch_compress<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, params: SketchParams, squares: bool, g: ArrayArg<R>, c: ArrayArg<R>) {
    let buckets = params.n.div_ceil(params.ratio);
    let (count, dim) = elementwise_geometry(client, buckets);
    let [k0, k1, k2, k3] = params.keys;
    // SAFETY: units past `buckets` exit; bucket `b` reads positions below `n`, whose preimages
    // under the permutation are below `n` too (`g` holds `n` values); `c` holds `buckets`.
    unsafe {
        compress_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            g,
            c,
            params.n as u32,
            params.ratio as u32,
            buckets as u32,
            params.half_bits,
            k0,
            k1,
            k2,
            k3,
            params.seed as u32,
            (params.seed >> 32) as u32,
            squares,
            dtype,
        )
    }
}

/// Decompress `⌈n / ratio⌉` f32 buckets into `n` values of `dtype`, signed or not.
pub fn launch_decompress<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, params: SketchParams, signed: bool, c: ArrayArg<R>, out: ArrayArg<R>) {
    let (count, dim) = elementwise_geometry(client, params.n);
    let [k0, k1, k2, k3] = params.keys;
    // SAFETY: units past `n` exit; a position below `n` divided by `ratio` is below the bucket
    // count `c` holds.
    unsafe {
        decompress_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            c,
            out,
            params.n as u32,
            params.ratio as u32,
            params.half_bits,
            k0,
            k1,
            k2,
            k3,
            params.seed as u32,
            (params.seed >> 32) as u32,
            signed,
            dtype,
        )
    }
}
