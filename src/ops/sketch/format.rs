//! The ternary gradient sketch on the host: the definition every path reproduces exactly.
//!
//! A vector `g` of `n` values is compressed at ratio `r` into `d = ⌈n / r⌉` values by a
//! hash-seeded ternary projection `P ∈ {−1, 0, +1}^{d × n}` that is never stored: each column `j`
//! has one nonzero, the sign `sⱼ = ±1`, in row `⌊π(j) / r⌋`, where `π` is a seeded permutation of
//! `0 … n−1`. So each compressed value is the signed sum of exactly `r` inputs (the last one of
//! fewer), and
//!
//! - compress: `c = P·g`, `c_b = Σ_{p = br}^{br + r − 1} s_{π⁻¹(p)} · g_{π⁻¹(p)}`, summed in `p` order
//!   (the same order on every path, so the f32 results are identical);
//! - decompress: `ĝ = Pᵀ·c`, `ĝⱼ = sⱼ · c_{⌊π(j)/r⌋}`; unsigned (for second moments):
//!   `v̂ⱼ = v_{⌊π(j)/r⌋}`.
//! - the squares' bucket sums `Σ g²` (for second moments) are the one result that may differ by
//!   a rounding per term between paths: a compiler may fuse `x·x + sum` (CUDA does).
//!
//! `ĝⱼ − gⱼ = Σ_{k ≠ j in j's bucket} sⱼ sₖ gₖ`: at most the absolute sum of its `r − 1` bucket
//! mates, zero on average over seeds, and `E‖ĝ − g‖² = (r − 1)·‖g‖²` when every bucket is full
//! (the signs are independent). `r = 1` is exact.
//!
//! `π` is a four-round Feistel network on the smallest even number of bits that covers `n`
//! (round function: the `mix32` hash of the half, the round and the seed), walked until it lands
//! below `n` (fewer than four steps on average, since the domain is under `4n`); its inverse runs
//! the rounds backwards with the same walk.

use crate::ops::trit::format::mix32;

/// Feistel rounds of the permutation.
const ROUNDS: u32 = 4;

/// The seeded projection of `n` values at ratio `r`: the sizes, the Feistel half width, the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Sketch {
    /// Values compressed.
    pub n: usize,
    /// Values per bucket.
    pub ratio: usize,
    pub seed: u64,
}

/// An invalid sketch or argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SketchError(pub String);

impl std::fmt::Display for SketchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kiln::sketch: {}", self.0)
    }
}

impl std::error::Error for SketchError {}

impl Sketch {
    /// A sketch of `n ≥ 1` values at ratio `r ≥ 1` (`n < 2³¹`).
    pub fn new(n: usize, ratio: usize, seed: u64) -> Result<Self, SketchError> {
        if n == 0 || n > i32::MAX as usize {
            return Err(SketchError(format!("a sketch covers 1 … {} values, got {n}", i32::MAX)));
        }
        if ratio == 0 {
            return Err(SketchError("the compression ratio must be at least 1, got 0".into()));
        }
        Ok(Self { n, ratio, seed })
    }

    /// Compressed values `d = ⌈n / r⌉`.
    pub fn compressed(&self) -> usize {
        self.n.div_ceil(self.ratio)
    }

    /// Bits of each Feistel half: the smallest `h` with `4ʰ ≥ n` (at least 1).
    pub fn half_bits(&self) -> u32 {
        let bits = usize::BITS - (self.n - 1).leading_zeros();
        bits.div_ceil(2).max(1)
    }

    /// The sign `sⱼ` of column `j`: true for −1.
    pub fn negative(&self, j: usize) -> bool {
        mix32((self.seed >> 32) as u32 ^ mix32(j as u32 ^ self.seed as u32)) >> 31 == 1
    }

    /// `π(j)`.
    pub fn position(&self, j: usize) -> usize {
        walk(j as u32, self.n as u32, |x| feistel(x, self.half_bits(), self.seed, false)) as usize
    }

    /// `π⁻¹(p)`.
    pub fn column(&self, p: usize) -> usize {
        walk(p as u32, self.n as u32, |x| feistel(x, self.half_bits(), self.seed, true)) as usize
    }

    /// `P·g` (module docs).
    ///
    /// # Panics
    /// If `g` does not hold `n` values (as every method taking a vector).
    pub fn compress(&self, g: &[f32]) -> Vec<f32> {
        self.check("compress", "g", g.len(), self.n);
        (0..self.compressed())
            .map(|b| {
                let mut sum = 0.0f32;
                for p in b * self.ratio..((b + 1) * self.ratio).min(self.n) {
                    let j = self.column(p);
                    sum += if self.negative(j) { -g[j] } else { g[j] };
                }
                sum
            })
            .collect()
    }

    /// `Pᵀ·c`, or the unsigned gather when `signed` is false.
    pub fn decompress(&self, c: &[f32], signed: bool) -> Vec<f32> {
        self.check("decompress", "c", c.len(), self.compressed());
        (0..self.n)
            .map(|j| {
                let v = c[self.position(j) / self.ratio];
                if signed && self.negative(j) { -v } else { v }
            })
            .collect()
    }

    #[track_caller]
    fn check(&self, op: &str, name: &str, got: usize, want: usize) {
        assert!(got == want, "kiln::sketch::{op}: {name} holds {got} values; the sketch of {} values at ratio {} needs {want}", self.n, self.ratio);
    }
}

/// One Feistel permutation step on `2h`-bit values (or its inverse).
pub(crate) fn feistel(x: u32, h: u32, seed: u64, inverse: bool) -> u32 {
    let mask = (1u32 << h) - 1;
    let (mut left, mut right) = (x >> h, x & mask);
    for i in 0..ROUNDS {
        let round = if inverse { ROUNDS - 1 - i } else { i };
        let key = mix32(seed as u32 ^ mix32((seed >> 32) as u32 ^ round));
        if inverse {
            // Undo `(l, r) → (r, l ^ F(r))`.
            let previous_right = left;
            left = right ^ (mix32(previous_right ^ key) & mask);
            right = previous_right;
        } else {
            (left, right) = (right, left ^ (mix32(right ^ key) & mask));
        }
    }
    (left << h) | right
}

/// Apply `step` from `x` until the value is below `n` (cycle walking).
fn walk(x: u32, n: u32, step: impl Fn(u32) -> u32) -> u32 {
    let mut y = step(x);
    while y >= n {
        y = step(y);
    }
    y
}
