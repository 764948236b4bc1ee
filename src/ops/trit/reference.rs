//! Packed trits from plain Burn ops, for any backend (and the tests' second oracle beside the
//! host definition): words unpacked to integer trits with shifts and masks, the algebra on
//! integers, packed back by summing bit values. Top-k sorts on the host.

use burn::tensor::{ElementConversion, Int, Tensor, TensorData, backend::Backend, ops::IntTensor};

use super::format::{self, TRITS_PER_WORD};
use super::{Metric, words_shape};

type Ints<B, const D: usize> = Tensor<B, D, Int>;

fn wrap<B: Backend, const D: usize>(t: IntTensor<B>) -> Ints<B, D> {
    Tensor::from_primitive(t)
}

/// `2^j` for the 32 bit positions as the backend's int (bit 31 as −2³¹: the i32 bit pattern).
fn bit_values<B: Backend>(device: &B::Device) -> Ints<B, 1> {
    let values: Vec<i32> = (0..TRITS_PER_WORD).map(|j| (1u32 << j) as i32).collect();
    Tensor::from_data(TensorData::new(values, [TRITS_PER_WORD]), device)
}

/// [`super::TritBackend::trit_pack`].
pub fn pack<B: Backend>(trits: IntTensor<B>) -> IntTensor<B> {
    let trits: Ints<B, 2> = wrap(trits);
    let [rows, len] = trits.dims();
    let pairs = format::word_pairs(len);
    let device = trits.device();
    let padded = if pairs * TRITS_PER_WORD > len {
        Tensor::cat(vec![trits, Tensor::zeros([rows, pairs * TRITS_PER_WORD - len], &device)], 1)
    } else {
        trits
    };
    let grouped = padded.reshape([rows, pairs, TRITS_PER_WORD]);
    let bits = bit_values::<B>(&device).reshape([1, 1, TRITS_PER_WORD]);
    let plane = |mask: Tensor<B, 3, burn::tensor::Bool>| (mask.int() * bits.clone()).sum_dim(2);
    let plus = plane(grouped.clone().greater_elem(0));
    let minus = plane(grouped.lower_elem(0));
    Tensor::cat(vec![plus, minus], 2).reshape([rows, 2 * pairs]).into_primitive()
}

/// `[rows, 32 · pairs]` trits of every word pair (zeros past the length).
fn unpack_all<B: Backend>(words: Ints<B, 2>) -> Ints<B, 2> {
    let [rows, width] = words.dims();
    let pairs = width / 2;
    let shifts: Ints<B, 1> = Tensor::arange(0..TRITS_PER_WORD as i64, &words.device());
    let shifts = shifts.reshape([1, 1, 1, TRITS_PER_WORD]).expand([rows, pairs, 2, TRITS_PER_WORD]);
    let planes = words.reshape([rows, pairs, 2, 1]).expand([rows, pairs, 2, TRITS_PER_WORD]).bitwise_right_shift(shifts).bitwise_and_scalar(1.elem());
    let plus = planes.clone().slice([0..rows, 0..pairs, 0..1]);
    let minus = planes.slice([0..rows, 0..pairs, 1..2]);
    (plus - minus).reshape([rows, pairs * TRITS_PER_WORD])
}

/// [`super::TritBackend::trit_unpack`].
pub fn unpack<B: Backend>(words: IntTensor<B>, len: usize) -> IntTensor<B> {
    let all = unpack_all::<B>(wrap(words));
    let rows = all.dims()[0];
    all.slice([0..rows, 0..len]).into_primitive()
}

/// [`super::TritBackend::trit_random`]: the host definition, uploaded.
pub fn random<B: Backend>(rows: usize, len: usize, seed: u64, threshold: u32, device: &B::Device) -> IntTensor<B> {
    let pairs = format::word_pairs(len);
    let mut bits = Vec::with_capacity(rows * 2 * pairs);
    for row in 0..rows {
        for w in 0..pairs {
            let (p, m) = format::random_pair(seed, row as u32, w as u32, threshold, format::valid_bits(len, w));
            bits.extend([p as i32, m as i32]);
        }
    }
    let words: Ints<B, 2> = Tensor::from_data(TensorData::new(bits, words_shape(rows, len)), device);
    words.into_primitive()
}

/// [`super::TritBackend::trit_bind`]: the product of the unpacked trits, packed.
pub fn bind<B: Backend>(a: IntTensor<B>, b: IntTensor<B>) -> IntTensor<B> {
    let (a, b) = (unpack_all::<B>(wrap(a)), unpack_all::<B>(wrap(b)));
    let b = b.expand(a.dims());
    pack::<B>((a * b).into_primitive())
}

/// [`super::TritBackend::trit_permute`]: the unpacked rows' last `shift` trits moved to the front.
pub fn permute<B: Backend>(words: IntTensor<B>, len: usize, shift: usize) -> IntTensor<B> {
    let trits: Ints<B, 2> = wrap(unpack::<B>(words, len));
    let rows = trits.dims()[0];
    let (tail, head) = (trits.clone().slice([0..rows, len - shift..len]), trits.slice([0..rows, 0..len - shift]));
    pack::<B>(Tensor::cat(vec![tail, head], 1).into_primitive())
}

/// [`super::TritBackend::trit_bundle`]: the sign of the (weighted) column sums.
pub fn bundle<B: Backend>(words: IntTensor<B>, len: usize, weights: Option<Vec<i32>>) -> IntTensor<B> {
    let trits: Ints<B, 2> = wrap(unpack::<B>(words, len));
    let rows = trits.dims()[0];
    let weighted = match weights {
        Some(w) => trits.clone() * Tensor::<B, 1, Int>::from_data(TensorData::new(w, [rows]), &trits.device()).reshape([rows, 1]),
        None => trits,
    };
    pack::<B>(weighted.sum_dim(0).sign().into_primitive())
}

/// [`super::TritBackend::trit_scores`] from elementwise products (or differences) of the
/// unpacked trits, summed: `[queries, rows, 32 · pairs]` materialized, a test-sized oracle.
pub fn scores<B: Backend>(queries: IntTensor<B>, memory: IntTensor<B>, metric: Metric, pairwise: bool) -> IntTensor<B> {
    let (q, m) = (unpack_all::<B>(wrap(queries)), unpack_all::<B>(wrap(memory)));
    let [rows, width] = m.dims();
    let (q, m): (Ints<B, 3>, Ints<B, 3>) = if pairwise {
        (q.expand([rows, width]).reshape([rows, 1, width]), m.reshape([rows, 1, width]))
    } else {
        let queries = q.dims()[0];
        (q.reshape([queries, 1, width]).expand([queries, rows, width]), m.reshape([1, rows, width]).expand([queries, rows, width]))
    };
    let per_trit = match metric {
        Metric::Dot => q * m,
        Metric::Hamming => q.not_equal(m).int(),
    };
    let [queries, rows, _] = per_trit.dims();
    let summed: Ints<B, 2> = per_trit.sum_dim(2).reshape([queries, rows]);
    if pairwise { summed.reshape([queries * rows]).into_primitive() } else { summed.into_primitive() }
}

/// [`super::TritBackend::trit_topk`]: a host sort per row by (score, index).
pub fn topk<B: Backend>(scores: IntTensor<B>, k: usize, smallest: bool) -> (IntTensor<B>, IntTensor<B>) {
    let scores: Ints<B, 2> = wrap(scores);
    let ([rows, n], device) = (scores.dims(), scores.device());
    let values: Vec<i64> = scores.into_data().convert::<i64>().into_vec().expect("int scores");
    let (mut best, mut at) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
    for row in values.chunks_exact(n.max(1)).take(rows) {
        for (i, v) in format::top_k(row, k, smallest) {
            best.push(v);
            at.push(i as i64);
        }
    }
    let upload = |v: Vec<i64>| -> IntTensor<B> { Tensor::<B, 2, Int>::from_data(TensorData::new(v, [rows, k]), &device).into_primitive() };
    (upload(best), upload(at))
}
