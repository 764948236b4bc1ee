//! Packed balanced-ternary vectors for vector-symbolic architectures: one exact algebra on the
//! host ([`TritVec`], plain Rust) and on the device ([`TritTensor`], CubeCL kernels on CUDA and
//! wgpu, plain Burn ops elsewhere), with similarity search.
//!
//! [`format`] defines the packing (two bit-planes per 32 trits) and every operation; the device
//! paths are tested for integer equality against it. Search ranks by an exact integer score
//! ([`Metric::Dot`] or [`Metric::Hamming`]) with ties broken by the lower index, so the host,
//! the reference and the kernels return the same top-k.

mod autodiff;
mod cube;
pub mod format;
mod fusion;
pub mod reference;

pub use format::{MAX_LEN, TRITS_PER_WORD, TritError, TritVec};
pub use kiln_kernels::trit::{Metric, TOPK_MAX_K};

use burn::tensor::{Bool, DType, Int, Shape, Tensor, TensorData, backend::Backend, ops::IntTensor};

use crate::error::ensure;

/// Backend support for packed trit vectors. Words are `[rows, 2 · pairs]` int tensors (u32 bit
/// patterns in the backend's int, or i32 on CubeCL backends); the default methods are the
/// reference.
pub trait TritBackend: Backend {
    /// `[rows, len]` integer trits (their signs) packed into words.
    fn trit_pack(trits: IntTensor<Self>) -> IntTensor<Self> {
        reference::pack::<Self>(trits)
    }

    /// Words of `len`-trit rows unpacked into `[rows, len]` integers in {−1, 0, 1}.
    fn trit_unpack(words: IntTensor<Self>, len: usize) -> IntTensor<Self> {
        reference::unpack::<Self>(words, len)
    }

    /// Rows `0 … rows` of the seeded random batch ([`format`]; `threshold` from
    /// [`format::density_threshold`]).
    fn trit_random(rows: usize, len: usize, seed: u64, threshold: u32, device: &Self::Device) -> IntTensor<Self> {
        reference::random::<Self>(rows, len, seed, threshold, device)
    }

    /// The elementwise product of `a` and `b` (`b` of one row or of `a`'s rows).
    fn trit_bind(a: IntTensor<Self>, b: IntTensor<Self>) -> IntTensor<Self> {
        reference::bind::<Self>(a, b)
    }

    /// Every row rotated: element `i` to `(i + shift) mod len`, `shift < len`.
    fn trit_permute(words: IntTensor<Self>, len: usize, shift: usize) -> IntTensor<Self> {
        reference::permute::<Self>(words, len, shift)
    }

    /// `sign(Σ wᵢ · rowᵢ)` as one row (weights 1 when `None`).
    fn trit_bundle(words: IntTensor<Self>, len: usize, weights: Option<Vec<i32>>) -> IntTensor<Self> {
        reference::bundle::<Self>(words, len, weights)
    }

    /// Scores `[queries, rows]` of every query row against every memory row, or `[rows]` of row
    /// `i` against query row `i` (or the single query row) when `pairwise`.
    fn trit_scores(queries: IntTensor<Self>, memory: IntTensor<Self>, metric: Metric, pairwise: bool) -> IntTensor<Self> {
        reference::scores::<Self>(queries, memory, metric, pairwise)
    }

    /// Per row of `scores [rows, n]`, the `k` best `(scores, indices)`: highest first, or lowest
    /// with `smallest`; ties to the lower index.
    fn trit_topk(scores: IntTensor<Self>, k: usize, smallest: bool) -> (IntTensor<Self>, IntTensor<Self>) {
        reference::topk::<Self>(scores, k, smallest)
    }
}

crate::backend::reference_backends!(TritBackend);

/// A batch of packed trit vectors of one length on the device: `[rows, 2 · ⌈len / 32⌉]` words
/// laid out as [`format`] documents.
#[derive(Debug, Clone)]
pub struct TritTensor<B: Backend> {
    words: Tensor<B, 2, Int>,
    len: usize,
}

impl<B: TritBackend> TritTensor<B> {
    /// Upload host vectors of one length as a batch.
    pub fn from_host(vectors: &[TritVec], device: &B::Device) -> Result<Self, TritError> {
        let Some(first) = vectors.first() else {
            return Err(TritError("from_host: no vectors".into()));
        };
        if let Some(v) = vectors.iter().find(|v| v.len() != first.len()) {
            return Err(TritError(format!("from_host: vectors of {} and {} trits in one batch", first.len(), v.len())));
        }
        let bits: Vec<i32> = vectors.iter().flat_map(|v| v.words().iter().map(|&w| w as i32)).collect();
        let width = 2 * format::word_pairs(first.len());
        let words = Tensor::from_data(TensorData::new(bits, [vectors.len(), width]), device);
        Ok(Self { words, len: first.len() })
    }

    /// Read the batch back to the host.
    pub fn to_host(&self) -> Vec<TritVec> {
        let data = self.words.clone().into_data().convert::<i64>();
        let words: Vec<u32> = data.into_vec::<i64>().expect("int words").into_iter().map(|w| w as u32).collect();
        let width = self.width();
        if width == 0 {
            return vec![TritVec::zeros(self.len); self.rows()];
        }
        words.chunks_exact(width).map(|w| TritVec::from_words(self.len, w.to_vec()).expect("device words keep the layout")).collect()
    }

    /// Pack `[rows, len]` integer trits; each value counts by its sign.
    pub fn from_int(trits: Tensor<B, 2, Int>) -> Self {
        let len = trits.dims()[1];
        ensure(len <= MAX_LEN, "trit::from_int", || format!("rows of {len} trits exceed {MAX_LEN}"));
        Self { words: Tensor::from_primitive(B::trit_pack(trits.into_primitive())), len }
    }

    /// Ternarize `[rows, len]` floats: +1 above `threshold`, −1 below `−threshold`, else 0.
    pub fn from_float(x: Tensor<B, 2>, threshold: f64) -> Self {
        ensure(threshold >= 0.0, "trit::from_float", || format!("threshold {threshold} is negative"));
        let up = x.clone().greater_elem(threshold).int();
        let down = x.lower_elem(-threshold).int();
        Self::from_int(up - down)
    }

    /// The trits as `[rows, len]` integers in {−1, 0, 1}.
    pub fn to_int(&self) -> Tensor<B, 2, Int> {
        Tensor::from_primitive(B::trit_unpack(self.words.clone().into_primitive(), self.len))
    }

    /// The trits as `[rows, len]` floats in {−1, 0, 1} (f32).
    pub fn to_float(&self) -> Tensor<B, 2> {
        self.to_int().float().cast(DType::F32)
    }

    /// `rows` vectors of the seeded random batch ([`TritVec::random`] gives row `r` on the host).
    pub fn random(rows: usize, len: usize, density: f64, seed: u64, device: &B::Device) -> Result<Self, TritError> {
        let threshold = format::density_threshold(density)?;
        if len > MAX_LEN || rows > u32::MAX as usize {
            return Err(TritError(format!("random: {rows} rows of {len} trits is out of range")));
        }
        Ok(Self { words: Tensor::from_primitive(B::trit_random(rows, len, seed, threshold, device)), len })
    }

    /// A batch from raw words `[rows, 2 · ⌈len / 32⌉]` already in the layout (unchecked: the
    /// device cannot validate without a read-back; [`TritTensor::to_host`] does).
    pub fn from_words(words: Tensor<B, 2, Int>, len: usize) -> Self {
        let width = words.dims()[1];
        ensure(width == 2 * format::word_pairs(len), "trit::from_words", || format!("{len} trits take {} words a row, got {width}", 2 * format::word_pairs(len)));
        Self { words, len }
    }

    /// The words.
    pub fn words(&self) -> &Tensor<B, 2, Int> {
        &self.words
    }

    /// Trits per vector.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the vectors have no trits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of vectors.
    pub fn rows(&self) -> usize {
        self.words.dims()[0]
    }

    fn width(&self) -> usize {
        self.words.dims()[1]
    }

    /// Bytes of packed words (4 a word).
    pub fn bytes(&self) -> usize {
        4 * self.rows() * self.width()
    }

    /// The device.
    pub fn device(&self) -> B::Device {
        self.words.device()
    }

    /// Rows `range` as a batch.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        Self { words: self.words.clone().slice([range]), len: self.len }
    }

    /// Rows at `indices` (an int tensor of row numbers).
    pub fn select(&self, indices: Tensor<B, 1, Int>) -> Self {
        Self { words: self.words.clone().select(0, indices), len: self.len }
    }

    /// The batches one after another.
    ///
    /// # Panics
    /// If `batches` is empty or their lengths differ.
    pub fn cat(batches: &[Self]) -> Self {
        ensure(!batches.is_empty(), "trit::cat", || "no batches".into());
        let len = batches[0].len;
        ensure(batches.iter().all(|b| b.len == len), "trit::cat", || {
            format!("batches of different lengths: {:?}", batches.iter().map(|b| b.len).collect::<Vec<_>>())
        });
        Self { words: Tensor::cat(batches.iter().map(|b| b.words.clone()).collect(), 0), len }
    }

    #[track_caller]
    fn check_pair(&self, other: &Self, op: &str) {
        ensure(self.len == other.len, op, || format!("vectors of {} and {} trits", self.len, other.len));
        ensure(other.rows() == 1 || other.rows() == self.rows(), op, || {
            format!("{} rows against {} rows (need equal counts or one row)", self.rows(), other.rows())
        });
    }

    /// The elementwise product with `other` (one row, or one per row of `self`).
    ///
    /// # Panics
    /// If the lengths differ or `other` has neither one row nor `self`'s count.
    pub fn bind(&self, other: &Self) -> Self {
        self.check_pair(other, "trit::bind");
        Self { words: Tensor::from_primitive(B::trit_bind(self.words.clone().into_primitive(), other.words.clone().into_primitive())), len: self.len }
    }

    /// [`TritTensor::bind`] by `key`, its own inverse where `key` is nonzero.
    pub fn unbind(&self, key: &Self) -> Self {
        self.bind(key)
    }

    /// Every row rotated: element `i` moves to `(i + shift) mod len`.
    pub fn permute(&self, shift: i64) -> Self {
        if self.len == 0 || self.rows() == 0 {
            return self.clone();
        }
        let shift = shift.rem_euclid(self.len as i64) as usize;
        if shift == 0 {
            return self.clone();
        }
        Self { words: Tensor::from_primitive(B::trit_permute(self.words.clone().into_primitive(), self.len, shift)), len: self.len }
    }

    /// The majority of the rows as one row: `sign(Σ rows)`, ties giving 0.
    ///
    /// # Panics
    /// If the batch has no rows.
    pub fn bundle(&self) -> Self {
        self.bundle_with(None)
    }

    /// `sign(Σ wᵢ · rowᵢ)` as one row, one integer weight per row, ties giving 0.
    ///
    /// # Panics
    /// If the weights are not one per row, or their absolute sum exceeds `i32::MAX`.
    pub fn bundle_weighted(&self, weights: &[i32]) -> Self {
        self.bundle_with(Some(weights.to_vec()))
    }

    fn bundle_with(&self, weights: Option<Vec<i32>>) -> Self {
        let ones;
        let checked = match &weights {
            Some(w) => w.as_slice(),
            None => {
                ones = vec![1; self.rows()];
                &ones
            }
        };
        format::check_bundle("bundle", self.rows(), checked);
        Self { words: Tensor::from_primitive(B::trit_bundle(self.words.clone().into_primitive(), self.len, weights)), len: self.len }
    }

    fn pairwise(&self, other: &Self, metric: Metric, op: &str) -> Tensor<B, 1, Int> {
        self.check_pair(other, op);
        Tensor::from_primitive(B::trit_scores(other.words.clone().into_primitive(), self.words.clone().into_primitive(), metric, true))
    }

    /// `Σ aᵢ · bᵢ` of each row with `other`'s (or its one row): `[rows]`.
    pub fn dot(&self, other: &Self) -> Tensor<B, 1, Int> {
        self.pairwise(other, Metric::Dot, "trit::dot")
    }

    /// Positions where each row differs from `other`'s (or its one row): `[rows]`.
    pub fn hamming(&self, other: &Self) -> Tensor<B, 1, Int> {
        self.pairwise(other, Metric::Hamming, "trit::hamming")
    }

    /// Nonzero trits of each row: `[rows]`.
    pub fn nnz(&self) -> Tensor<B, 1, Int> {
        self.dot(self)
    }

    /// `dot / √(nnz(a) · nnz(b))` per row, 0 where either row is all zeros: `[rows]` f32, from
    /// the exact integer counts (so within an f32 rounding of [`TritVec::cosine`]).
    pub fn cosine(&self, other: &Self) -> Tensor<B, 1> {
        let dot = self.dot(other).float().cast(DType::F32);
        let norms = self.nnz().float().cast(DType::F32) * other.nnz().float().cast(DType::F32);
        let zero: Tensor<B, 1, Bool> = norms.clone().equal_elem(0.0);
        (dot / norms.mask_fill(zero.clone(), 1.0).sqrt()).mask_fill(zero, 0.0)
    }

    /// Scores `[self.rows, memory.rows]` of every row of `self` (the queries) against every
    /// row of `memory`.
    ///
    /// # Panics
    /// If the lengths differ.
    pub fn similarity(&self, memory: &Self, metric: Metric) -> Tensor<B, 2, Int> {
        ensure(self.len == memory.len, "trit::similarity", || format!("queries of {} trits against vectors of {}", self.len, memory.len));
        Tensor::from_primitive(B::trit_scores(self.words.clone().into_primitive(), memory.words.clone().into_primitive(), metric, false))
    }

    /// For each row of `self`, the `k` most similar rows of `memory`: `(scores, indices)`, each
    /// `[self.rows, k]`, best first (highest dot, lowest Hamming), ties to the lower index.
    ///
    /// # Panics
    /// If the lengths differ or `k` is 0 or more than `memory`'s rows.
    pub fn search(&self, memory: &Self, metric: Metric, k: usize) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        ensure(k >= 1 && k <= memory.rows(), "trit::search", || format!("k = {k} of {} stored vectors", memory.rows()));
        let scores = self.similarity(memory, metric);
        let (values, indices) = B::trit_topk(scores.into_primitive(), k, metric == Metric::Hamming);
        (Tensor::from_primitive(values), Tensor::from_primitive(indices))
    }
}

/// The shape of words for `rows` rows of `len` trits.
pub(crate) fn words_shape(rows: usize, len: usize) -> Shape {
    Shape::new([rows, 2 * format::word_pairs(len)])
}
