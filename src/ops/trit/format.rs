//! The packed trit vector on the host ([`TritVec`]): the definition of the layout and of the
//! algebra, in plain Rust. The CubeCL kernels and the reference in Burn ops must agree with it
//! exactly (integer equality), which the tests check on random vectors.
//!
//! # Layout
//! Element `i` of a vector of `len` trits lives at bit `i % 32` of word pair `i / 32`: the pair's
//! first word is the **plus plane** (bit set ⇔ `+1`), its second the **minus plane** (bit set ⇔
//! `−1`); neither set ⇔ `0`, both set is invalid. A vector holds `⌈len / 32⌉` pairs interleaved
//! `[plus₀, minus₀, plus₁, minus₁, …]`; bits past `len` are zero.
//!
//! Why two planes rather than 2-bit codes: every operation becomes a few bitwise instructions on
//! whole words (bind is four ANDs and two ORs, a dot product two popcounts), where 2-bit codes
//! would need the planes separated by shifts and masks first. Why interleaved: one 8- or 16-byte
//! load brings both planes of the same trits, so a kernel reads a vector front to back once.
//!
//! # Algebra (the same on every path)
//! - `bind(a, b)ᵢ = aᵢ · bᵢ`; `unbind(c, key) = bind(c, key)` (exact where `key` is nonzero).
//! - `bundle(v₁ … vₙ; w₁ … wₙ)ᵢ = sign(Σⱼ wⱼ · vⱼ,ᵢ)` with integer weights (1 when unweighted) and
//!   `sign(0) = 0`: a tie gives 0.
//! - `permute(v, s)`: element `i` moves to `(i + s) mod len`, for any shift `s` (negative too).
//! - `dot(a, b) = Σ aᵢ · bᵢ`; `nnz(a) = dot(a, a)`; `hamming(a, b) = #{i : aᵢ ≠ bᵢ}`;
//!   `cosine(a, b) = dot / √(nnz(a) · nnz(b))`, 0 when either vector is all zeros.
//! - `random(len, density, seed)`: element `i` of row `r` is nonzero with probability `density`,
//!   then `±1` with equal probability, decided by a counter-based hash of `(seed, r, i)` (so any
//!   path reproduces any row without generating the others).

use serde::{Deserialize, Serialize};

/// Trits per word.
pub const TRITS_PER_WORD: usize = 32;

/// The longest vector: every count fits an `i32` (the device accumulators).
pub const MAX_LEN: usize = i32::MAX as usize;

/// An invalid trit vector or argument, with what was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TritError(pub String);

impl std::fmt::Display for TritError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kiln::trit: {}", self.0)
    }
}

impl std::error::Error for TritError {}

fn err<T>(message: String) -> Result<T, TritError> {
    Err(TritError(message))
}

/// Word pairs of a vector of `len` trits.
pub fn word_pairs(len: usize) -> usize {
    len.div_ceil(TRITS_PER_WORD)
}

/// The mask of the valid bits of word pair `w` of a vector of `len` trits.
pub(crate) fn valid_bits(len: usize, w: usize) -> u32 {
    let rest = len - w * TRITS_PER_WORD;
    if rest >= TRITS_PER_WORD { u32::MAX } else { (1u32 << rest) - 1 }
}

/// A vector of `len` balanced trits (−1, 0, +1), packed as two bit-planes (module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawTritVec", into = "RawTritVec")]
pub struct TritVec {
    len: usize,
    words: Vec<u32>,
}

/// The serialized form, validated on the way in.
#[derive(Serialize, Deserialize)]
struct RawTritVec {
    len: usize,
    words: Vec<u32>,
}

impl TryFrom<RawTritVec> for TritVec {
    type Error = TritError;
    fn try_from(raw: RawTritVec) -> Result<Self, TritError> {
        TritVec::from_words(raw.len, raw.words)
    }
}

impl From<TritVec> for RawTritVec {
    fn from(v: TritVec) -> Self {
        RawTritVec { len: v.len, words: v.words }
    }
}

impl TritVec {
    /// `len` zeros.
    pub fn zeros(len: usize) -> Self {
        Self { len, words: vec![0; 2 * word_pairs(len)] }
    }

    /// From trits given as `i8` values in {−1, 0, 1}.
    pub fn from_i8(trits: &[i8]) -> Result<Self, TritError> {
        if let Some(i) = trits.iter().position(|t| !(-1..=1).contains(t)) {
            return err(format!("from_i8: element {i} is {}, not a trit (−1, 0 or 1)", trits[i]));
        }
        Self::check_len(trits.len())?;
        let mut v = Self::zeros(trits.len());
        for (i, &t) in trits.iter().enumerate() {
            v.put(i, t);
        }
        Ok(v)
    }

    /// From packed words (the layout of the module docs): `2 · ⌈len / 32⌉` words, no trit with
    /// both planes set, no bit set past `len`.
    pub fn from_words(len: usize, words: Vec<u32>) -> Result<Self, TritError> {
        Self::check_len(len)?;
        let pairs = word_pairs(len);
        if words.len() != 2 * pairs {
            return err(format!("from_words: {len} trits take {} words, got {}", 2 * pairs, words.len()));
        }
        for w in 0..pairs {
            let (p, m) = (words[2 * w], words[2 * w + 1]);
            if p & m != 0 {
                return err(format!("from_words: word pair {w} sets both planes at bits {:#010x}", p & m));
            }
            if (p | m) & !valid_bits(len, w) != 0 {
                return err(format!("from_words: word pair {w} sets bits past the length {len}"));
            }
        }
        Ok(Self { len, words })
    }

    /// Row `row` of the seeded random batch (module docs): each trit nonzero with probability
    /// `density` in (0, 1], then ±1 with equal probability.
    pub fn random(len: usize, density: f64, seed: u64, row: u32) -> Result<Self, TritError> {
        Self::check_len(len)?;
        let threshold = density_threshold(density)?;
        let mut v = Self::zeros(len);
        for w in 0..word_pairs(len) {
            let (p, m) = random_pair(seed, row, w as u32, threshold, valid_bits(len, w));
            v.words[2 * w] = p;
            v.words[2 * w + 1] = m;
        }
        Ok(v)
    }

    fn check_len(len: usize) -> Result<(), TritError> {
        if len > MAX_LEN {
            return err(format!("a vector holds at most {MAX_LEN} trits, got {len}"));
        }
        Ok(())
    }

    /// Number of trits.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the vector has no trits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed words (module docs).
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Trit `i`.
    ///
    /// # Panics
    /// If `i ≥ len`.
    pub fn get(&self, i: usize) -> i8 {
        assert!(i < self.len, "kiln::trit::get: index {i} out of a vector of {} trits", self.len);
        let (w, bit) = (i / TRITS_PER_WORD, i % TRITS_PER_WORD);
        ((self.words[2 * w] >> bit) & 1) as i8 - ((self.words[2 * w + 1] >> bit) & 1) as i8
    }

    /// Set trit `i` to `t` (its sign: any positive value is +1, any negative −1).
    ///
    /// # Panics
    /// If `i ≥ len`.
    pub fn set(&mut self, i: usize, t: i8) {
        assert!(i < self.len, "kiln::trit::set: index {i} out of a vector of {} trits", self.len);
        self.put(i, t);
    }

    fn put(&mut self, i: usize, t: i8) {
        let (w, bit) = (i / TRITS_PER_WORD, 1u32 << (i % TRITS_PER_WORD));
        self.words[2 * w] = if t > 0 { self.words[2 * w] | bit } else { self.words[2 * w] & !bit };
        self.words[2 * w + 1] = if t < 0 { self.words[2 * w + 1] | bit } else { self.words[2 * w + 1] & !bit };
    }

    /// The trits as `i8` values.
    pub fn to_i8(&self) -> Vec<i8> {
        (0..self.len).map(|i| self.get(i)).collect()
    }

    fn pairs(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.words.chunks_exact(2).map(|p| (p[0], p[1]))
    }

    #[track_caller]
    fn same_len(&self, other: &Self, op: &str) {
        assert!(self.len == other.len, "kiln::trit::{op}: lengths differ ({} and {} trits)", self.len, other.len);
    }

    /// The elementwise product.
    ///
    /// # Panics
    /// If the lengths differ (as every binary operation here).
    pub fn bind(&self, other: &Self) -> Self {
        self.same_len(other, "bind");
        let words = self.pairs().zip(other.pairs()).flat_map(|(a, b)| {
            let (p, m) = bind_pair(a, b);
            [p, m]
        });
        Self { len: self.len, words: words.collect() }
    }

    /// The inverse of [`TritVec::bind`] by `key` where `key` is nonzero (the same product).
    pub fn unbind(&self, key: &Self) -> Self {
        self.bind(key)
    }

    /// Cyclic shift: element `i` moves to `(i + shift) mod len`.
    pub fn permute(&self, shift: i64) -> Self {
        let mut out = Self::zeros(self.len);
        if self.len == 0 {
            return out;
        }
        let shift = shift.rem_euclid(self.len as i64) as usize;
        for w in 0..word_pairs(self.len) {
            // Output trits [32w, 32w + 32) come from source trits starting at 32w − shift (mod len).
            let start = (w * TRITS_PER_WORD + self.len - shift) % self.len;
            let valid = valid_bits(self.len, w);
            out.words[2 * w] = rotated_field(&self.words, 0, self.len, start) & valid;
            out.words[2 * w + 1] = rotated_field(&self.words, 1, self.len, start) & valid;
        }
        out
    }

    /// `Σ aᵢ · bᵢ`.
    pub fn dot(&self, other: &Self) -> i64 {
        self.same_len(other, "dot");
        self.pairs().zip(other.pairs()).map(|(a, b)| dot_pair(a, b)).sum()
    }

    /// Number of nonzero trits.
    pub fn nnz(&self) -> i64 {
        self.pairs().map(|(p, m)| (p | m).count_ones() as i64).sum()
    }

    /// Number of positions where the trits differ.
    pub fn hamming(&self, other: &Self) -> i64 {
        self.same_len(other, "hamming");
        self.pairs().zip(other.pairs()).map(|(a, b)| hamming_pair(a, b)).sum()
    }

    /// `dot / √(nnz(a) · nnz(b))`, 0 when either vector is all zeros.
    pub fn cosine(&self, other: &Self) -> f64 {
        cosine(self.dot(other), self.nnz(), other.nnz())
    }

    /// The majority of `vectors` per trit, `sign(Σ vᵢ)` with ties giving 0.
    ///
    /// # Panics
    /// If `vectors` is empty or their lengths differ.
    pub fn bundle(vectors: &[&Self]) -> Self {
        Self::bundle_weighted(vectors, &vec![1; vectors.len()])
    }

    /// `sign(Σ wᵢ · vᵢ)` per trit with integer weights, ties giving 0.
    ///
    /// # Panics
    /// If `vectors` is empty, their lengths differ, the weights are not one per vector, or the
    /// weights' absolute sum exceeds `i32::MAX` (the device accumulates in `i32`).
    pub fn bundle_weighted(vectors: &[&Self], weights: &[i32]) -> Self {
        check_bundle("bundle", vectors.len(), weights);
        let len = vectors[0].len;
        vectors.iter().for_each(|v| vectors[0].same_len(v, "bundle"));
        let mut sums = vec![0i64; len];
        for (v, &w) in vectors.iter().zip(weights) {
            for (i, s) in sums.iter_mut().enumerate() {
                *s += w as i64 * v.get(i) as i64;
            }
        }
        let signs: Vec<i8> = sums.iter().map(|s| s.signum() as i8).collect();
        Self::from_i8(&signs).expect("signs are trits")
    }
}

/// The `k` best entries of `scores` as `(index, score)`, best first: highest scores (lowest with
/// `smallest`), ties to the lower index. `k` is capped at `scores.len()`.
pub fn top_k(scores: &[i64], k: usize, smallest: bool) -> Vec<(usize, i64)> {
    let mut order: Vec<(usize, i64)> = scores.iter().copied().enumerate().collect();
    let key = |&(i, s): &(usize, i64)| (if smallest { s } else { -s }, i);
    let k = k.min(order.len());
    if k < order.len() {
        order.select_nth_unstable_by_key(k, key);
        order.truncate(k);
    }
    order.sort_unstable_by_key(key);
    order
}

/// The `k` rows of `memory` most similar to `query` as `(index, score)`, best first (highest
/// dot, lowest Hamming), ties to the lower index: the host side of `TritTensor::search`.
///
/// # Panics
/// If a length differs from the query's.
pub fn search(query: &TritVec, memory: &[TritVec], metric: kiln_kernels::trit::Metric, k: usize) -> Vec<(usize, i64)> {
    use kiln_kernels::trit::Metric;
    let scores: Vec<i64> = memory
        .iter()
        .map(|m| match metric {
            Metric::Dot => query.dot(m),
            Metric::Hamming => query.hamming(m),
        })
        .collect();
    top_k(&scores, k, metric == Metric::Hamming)
}

/// Check a bundle's operand count and weights; `op` names the caller in the message.
#[track_caller]
pub(crate) fn check_bundle(op: &str, count: usize, weights: &[i32]) {
    assert!(count > 0, "kiln::trit::{op}: nothing to bundle (no vectors)");
    assert!(weights.len() == count, "kiln::trit::{op}: {} weights for {count} vectors", weights.len());
    let total: i64 = weights.iter().map(|w| (*w as i64).abs()).sum();
    assert!(total <= i32::MAX as i64, "kiln::trit::{op}: the weights' absolute sum {total} exceeds i32::MAX");
}

/// `dot / √(na · nb)`, 0 when either count is 0.
pub(crate) fn cosine(dot: i64, na: i64, nb: i64) -> f64 {
    if na == 0 || nb == 0 { 0.0 } else { dot as f64 / ((na as f64) * (nb as f64)).sqrt() }
}

/// The product of two word pairs.
pub(crate) fn bind_pair((ap, am): (u32, u32), (bp, bm): (u32, u32)) -> (u32, u32) {
    ((ap & bp) | (am & bm), (ap & bm) | (am & bp))
}

/// `Σ aᵢ · bᵢ` over one word pair.
pub(crate) fn dot_pair(a: (u32, u32), b: (u32, u32)) -> i64 {
    let (p, m) = bind_pair(a, b);
    p.count_ones() as i64 - m.count_ones() as i64
}

/// Differing positions in one word pair.
pub(crate) fn hamming_pair((ap, am): (u32, u32), (bp, bm): (u32, u32)) -> i64 {
    ((ap ^ bp) | (am ^ bm)).count_ones() as i64
}

/// 32 bits of plane `plane` read from trit `start` on, wrapping at `len`.
fn rotated_field(words: &[u32], plane: usize, len: usize, start: usize) -> u32 {
    let first = field(words, plane, start, (len - start).min(TRITS_PER_WORD));
    let taken = len - start;
    if taken >= TRITS_PER_WORD {
        first
    } else {
        first | field(words, plane, 0, (TRITS_PER_WORD - taken).min(len)) << taken
    }
}

/// `count` (≤ 32) bits of plane `plane` from trit `start`, low bits first; bits past the vector
/// read as zero.
fn field(words: &[u32], plane: usize, start: usize, count: usize) -> u32 {
    let (w, shift) = (start / TRITS_PER_WORD, start % TRITS_PER_WORD);
    let low = words[2 * w + plane] >> shift;
    let high = if shift > 0 && 2 * (w + 1) + plane < words.len() { words[2 * (w + 1) + plane] << (32 - shift) } else { 0 };
    let bits = low | high;
    if count >= TRITS_PER_WORD { bits } else { bits & ((1u32 << count) - 1) }
}

/// The 32-bit threshold of a density: a trit is nonzero when its hash is at most the threshold.
pub fn density_threshold(density: f64) -> Result<u32, TritError> {
    if !(density > 0.0 && density <= 1.0) {
        return err(format!("density must be in (0, 1], got {density}"));
    }
    // P(h ≤ t) = (t + 1) / 2³² for a uniform 32-bit h.
    Ok(((density * 4294967296.0).round() - 1.0).clamp(0.0, u32::MAX as f64) as u32)
}

/// One round of a 32-bit integer hash (Wellons' "lowbias32" constants): full avalanche with
/// multiplies, shifts and XORs only, so every path (WGSL included) computes it the same way.
pub fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The hash of trit `i` of row `row` under `seed`.
pub fn trit_hash(seed: u64, row: u32, i: u32) -> u32 {
    mix32(seed as u32 ^ mix32((seed >> 32) as u32 ^ mix32(row ^ mix32(i))))
}

/// Word pair `w` of row `row` of a random batch, masked to `valid` bits.
pub(crate) fn random_pair(seed: u64, row: u32, w: u32, threshold: u32, valid: u32) -> (u32, u32) {
    let (mut p, mut m) = (0u32, 0u32);
    for bit in 0..TRITS_PER_WORD as u32 {
        let h = trit_hash(seed, row, w * TRITS_PER_WORD as u32 + bit);
        let nonzero = h <= threshold;
        let negative = mix32(h) & 1 == 1;
        p |= ((nonzero && !negative) as u32) << bit;
        m |= ((nonzero && negative) as u32) << bit;
    }
    (p & valid, m & valid)
}
