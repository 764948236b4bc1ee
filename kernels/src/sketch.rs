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

/// The seeded permutation and the signs as kernels take them ([`SketchParams::permutation`]).
#[derive(CubeLaunch, CubeType)]
pub struct Permutation {
    n: u32,
    ratio: u32,
    /// Feistel half width in bits, and the four round keys.
    h: u32,
    k0: u32,
    k1: u32,
    k2: u32,
    k3: u32,
    seed_low: u32,
    seed_high: u32,
}

impl SketchParams {
    /// The kernels' argument for this sketch.
    pub fn permutation<R: Runtime>(&self) -> PermutationLaunch<R> {
        let [k0, k1, k2, k3] = self.keys;
        PermutationLaunch::new(self.n as u32, self.ratio as u32, self.half_bits, k0, k1, k2, k3, self.seed as u32, (self.seed >> 32) as u32)
    }
}

/// `π(x)` (or `π⁻¹`) by cycle walking below `n`.
#[cube]
fn permute(x: u32, perm: &Permutation, #[comptime] inverse: bool) -> u32 {
    let mut y = feistel(x, perm.h, perm.k0, perm.k1, perm.k2, perm.k3, inverse);
    while y >= perm.n {
        y = feistel(y, perm.h, perm.k0, perm.k1, perm.k2, perm.k3, inverse);
    }
    y
}

/// Whether column `j` has sign −1.
#[cube]
fn negative(j: u32, perm: &Permutation) -> bool {
    (mix32(perm.seed_high ^ mix32(j ^ perm.seed_low)) >> 31u32) == 1u32
}

/// `x` with column `j`'s sign.
#[cube]
fn signed(x: f32, j: u32, perm: &Permutation) -> f32 {
    select(negative(j, perm), -x, x)
}

/// The bucket column `j` falls in: its position under π, divided by the ratio.
#[cube]
fn bucket(j: u32, perm: &Permutation) -> usize {
    (permute(j, perm, false) / perm.ratio) as usize
}

/// One unit per bucket: the signed sum of its inputs in position order (or the plain sum of
/// their squares for `squares`), in f32.
#[cube(launch_unchecked)]
fn compress_kernel<F: Float>(g: &Array<F>, c: &mut Array<f32>, perm: Permutation, buckets: u32, #[comptime] squares: bool, #[define(F)] _dtype: StorageType) {
    let b = ABSOLUTE_POS as u32;
    if b >= buckets {
        terminate!();
    }
    let mut sum = 0.0f32;
    // Bucket b's positions, in order; π⁻¹ maps each to its column.
    let first = b * perm.ratio;
    for p in first..(first + perm.ratio).min(perm.n) {
        let j = permute(p, &perm, true);
        let x = f32::cast_from(g[j as usize]);
        if comptime!(squares) {
            sum += x * x;
        } else {
            sum += signed(x, j, &perm);
        }
    }
    c[b as usize] = sum;
}

/// One unit per element: its bucket's value, signed (`Pᵀ·c`) or not.
#[cube(launch_unchecked)]
fn decompress_kernel<F: Float>(c: &Array<f32>, out: &mut Array<F>, perm: Permutation, #[comptime] signs: bool, #[define(F)] _dtype: StorageType) {
    let j = ABSOLUTE_POS as u32;
    if j >= perm.n {
        terminate!();
    }
    let v = c[bucket(j, &perm)];
    let mut value = v;
    if comptime!(signs) {
        value = signed(v, j, &perm);
    }
    out[j as usize] = F::cast_from(value);
}

/// Compress `g` (`n` values of `dtype`) into `⌈n / ratio⌉` f32 bucket sums: signed, or of the
/// squares (unsigned) with `squares`.
pub fn launch_compress<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, params: SketchParams, squares: bool, g: ArrayArg<R>, c: ArrayArg<R>) {
    let buckets = params.n.div_ceil(params.ratio);
    let (count, dim) = elementwise_geometry(client, buckets);
    // SAFETY: units past `buckets` exit; bucket `b` reads positions below `n`, whose preimages
    // under the permutation are below `n` too (`g` holds `n` values); `c` holds `buckets`.
    unsafe { compress_kernel::launch_unchecked::<R>(client, count, dim, g, c, params.permutation(), buckets as u32, squares, dtype) }
}

/// Decompress `⌈n / ratio⌉` f32 buckets into `n` values of `dtype`, signed or not.
pub fn launch_decompress<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, params: SketchParams, signed: bool, c: ArrayArg<R>, out: ArrayArg<R>) {
    let (count, dim) = elementwise_geometry(client, params.n);
    // SAFETY: units past `n` exit; a position below `n` divided by `ratio` is below the bucket
    // count `c` holds.
    unsafe { decompress_kernel::launch_unchecked::<R>(client, count, dim, c, out, params.permutation(), signed, dtype) }
}

/// The f32 scalars of one sketched-AdamW step, computed once on the host so that every path uses
/// the same values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    pub beta_1: f32,
    pub beta_2: f32,
    /// `1 − β₁ᵗ`.
    pub bias_1: f32,
    /// `r · (1 − β₂ᵗ)`: a bucket's sum of squares over it is the bias-corrected mean square.
    pub v_scale: f32,
    pub epsilon: f32,
    pub lr: f32,
    /// `1 − lr · λ` (decoupled weight decay).
    pub decay: f32,
}

impl AdamWScalars {
    /// The scalars of step `time` (from 1) at learning rate `lr`, for buckets of `ratio` values.
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32, lr: f64, time: usize, ratio: usize) -> Self {
        let t = time.min(i32::MAX as usize) as i32;
        Self {
            beta_1,
            beta_2,
            bias_1: (1.0 - (beta_1 as f64).powi(t)) as f32,
            v_scale: (ratio as f64 * (1.0 - (beta_2 as f64).powi(t))) as f32,
            epsilon,
            lr: lr as f32,
            decay: (1.0 - lr * weight_decay as f64) as f32,
        }
    }
}

/// The step's scalars as a kernel argument.
#[derive(CubeLaunch, CubeType)]
struct StepScalars {
    bias_1: f32,
    v_scale: f32,
    epsilon: f32,
    lr: f32,
    decay: f32,
}

/// One unit per bucket: both moments' bucket sums from one gather of `g`, folded into the
/// moments (`m ← β₁m + (1 − β₁)·P·g`, `v ← β₂v + (1 − β₂)·|P|·g²`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn moments_kernel<F: Float>(
    g: &Array<F>,
    m: &Array<f32>,
    v: &Array<f32>,
    m_out: &mut Array<f32>,
    v_out: &mut Array<f32>,
    perm: Permutation,
    buckets: u32,
    beta_1: f32,
    beta_2: f32,
    #[define(F)] _dtype: StorageType,
) {
    let b = ABSOLUTE_POS as u32;
    if b >= buckets {
        terminate!();
    }
    // Separate bindings: CubeCL makes a destructured tuple's variables constants.
    let mut sum = 0.0f32;
    let mut squares = 0.0f32;
    let first = b * perm.ratio;
    for p in first..(first + perm.ratio).min(perm.n) {
        let j = permute(p, &perm, true);
        let x = f32::cast_from(g[j as usize]);
        sum += signed(x, j, &perm);
        squares += x * x;
    }
    let i = b as usize;
    m_out[i] = m[i] * beta_1 + sum * (1.0 - beta_1);
    v_out[i] = v[i] * beta_2 + squares * (1.0 - beta_2);
}

/// One unit per element: its bias-corrected moments from its bucket, then
/// `w ← w·decay − lr · m̂ / (√v̂ + ε)`, in f32 and rounded once to the parameter's type.
#[cube(launch_unchecked)]
fn update_kernel<F: Float>(w: &Array<F>, m: &Array<f32>, v: &Array<f32>, out: &mut Array<F>, perm: Permutation, s: StepScalars, #[define(F)] _dtype: StorageType) {
    let j = ABSOLUTE_POS as u32;
    if j >= perm.n {
        terminate!();
    }
    let b = bucket(j, &perm);
    let m_hat = signed(m[b] / s.bias_1, j, &perm);
    let v_hat = v[b] / s.v_scale;
    let delta = m_hat / (v_hat.sqrt() + s.epsilon);
    out[j as usize] = F::cast_from(f32::cast_from(w[j as usize]) * s.decay - delta * s.lr);
}

/// The bindings of a fused sketched-AdamW step: the parameter and its gradient (`n` values of
/// `dtype`), the moments (`⌈n / r⌉` f32 each) and the new parameter and moments.
pub struct AdamWArgs<R: Runtime> {
    pub param: ArrayArg<R>,
    pub grad: ArrayArg<R>,
    pub moments: [ArrayArg<R>; 2],
    pub param_out: ArrayArg<R>,
    pub moments_out: [ArrayArg<R>; 2],
    /// The new moments again, bound for the update (a launch consumes its `ArrayArg`s, which do
    /// not clone).
    pub moments_read: [ArrayArg<R>; 2],
}

/// One sketched-AdamW step in two kernels: the moments (one gather of the gradient per bucket for
/// both), then the parameter update (one permutation per element).
pub fn launch_adamw_step<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, params: SketchParams, scalars: AdamWScalars, args: AdamWArgs<R>) {
    let buckets = params.n.div_ceil(params.ratio);
    let (count, dim) = elementwise_geometry(client, buckets);
    let [m, v] = args.moments;
    let [m_out, v_out] = args.moments_out;
    // SAFETY: as `launch_compress` for the gradient; the moments hold `buckets` values each.
    unsafe {
        moments_kernel::launch_unchecked::<R>(client, count, dim, args.grad, m, v, m_out, v_out, params.permutation(), buckets as u32, scalars.beta_1, scalars.beta_2, dtype)
    }
    let (count, dim) = elementwise_geometry(client, params.n);
    let [m, v] = args.moments_read;
    let s = StepScalarsLaunch::new(scalars.bias_1, scalars.v_scale, scalars.epsilon, scalars.lr, scalars.decay);
    // SAFETY: as `launch_decompress`; the parameter and its output hold `n` values.
    unsafe { update_kernel::launch_unchecked::<R>(client, count, dim, args.param, m, v, args.param_out, params.permutation(), s, dtype) }
}
