//! Packed trits as custom operations of Burn's fusion stream: every operand is an int tensor;
//! the generator has none and is recorded on its device's stream.

use burn::tensor::{DType, Shape, ops::{FloatTensor, IntTensor}};
use burn_fusion::{Fusion, FusionBackend};

use super::{Metric, TritBackend, words_shape};
use crate::backend::fusion::{FusedMixedOp, Operand, register_mixed, register_source};

type Mixed<B> = Operand<FloatTensor<B>, IntTensor<B>>;

/// The op family named in the panics of a wrong operand.
const OP: &str = "trit";

#[derive(Clone, Debug)]
enum Op<D> {
    Pack,
    Unpack { len: usize },
    Random { rows: usize, len: usize, seed: u64, threshold: u32, device: D },
    Bind,
    Permute { len: usize, shift: usize },
    Bundle { len: usize, weights: Option<Vec<i32>> },
    Scores { metric: Metric, pairwise: bool },
    Topk { k: usize, smallest: bool },
}

impl<B: FusionBackend + TritBackend> FusedMixedOp<B> for Op<B::Device> {
    fn run(&self, inputs: Vec<Mixed<B>>) -> Vec<Mixed<B>> {
        let mut inputs = inputs.into_iter();
        let mut next = || Operand::int(inputs.next(), OP);
        let out = match self {
            Op::Pack => B::trit_pack(next()),
            Op::Unpack { len } => B::trit_unpack(next(), *len),
            Op::Random { rows, len, seed, threshold, device } => B::trit_random(*rows, *len, *seed, *threshold, device),
            Op::Bind => B::trit_bind(next(), next()),
            Op::Permute { len, shift } => B::trit_permute(next(), *len, *shift),
            Op::Bundle { len, weights } => B::trit_bundle(next(), *len, weights.clone()),
            Op::Scores { metric, pairwise } => B::trit_scores(next(), next(), *metric, *pairwise),
            Op::Topk { k, smallest } => {
                let (values, indices) = B::trit_topk(next(), *k, *smallest);
                return vec![Operand::Int(values), Operand::Int(indices)];
            }
        };
        vec![Operand::Int(out)]
    }
}

/// Record `op` on `inputs`' stream with int outputs of `shapes`.
fn record<B: FusionBackend + TritBackend>(name: &'static str, inputs: Vec<IntTensor<Fusion<B>>>, shapes: Vec<Shape>, op: Op<B::Device>) -> Vec<IntTensor<Fusion<B>>> {
    register_mixed::<B, _>(name, inputs, shapes.into_iter().map(|s| (s, DType::I32)).collect(), op)
}

impl<B: FusionBackend + TritBackend> TritBackend for Fusion<B> {
    fn trit_pack(trits: IntTensor<Self>) -> IntTensor<Self> {
        let shape = words_shape(trits.shape[0], trits.shape[1]);
        record::<B>("kiln_trit_pack", vec![trits], vec![shape], Op::Pack).remove(0)
    }

    fn trit_unpack(words: IntTensor<Self>, len: usize) -> IntTensor<Self> {
        let shape = Shape::new([words.shape[0], len]);
        let dtype = <B::IntElem as burn::tensor::Element>::dtype();
        register_mixed::<B, _>("kiln_trit_unpack", vec![words], vec![(shape, dtype)], Op::Unpack { len }).remove(0)
    }

    fn trit_random(rows: usize, len: usize, seed: u64, threshold: u32, device: &Self::Device) -> IntTensor<Self> {
        let op = Op::Random { rows, len, seed, threshold, device: device.clone() };
        register_source::<B, _>("kiln_trit_random", device, vec![(words_shape(rows, len), DType::I32)], op).remove(0)
    }

    fn trit_bind(a: IntTensor<Self>, b: IntTensor<Self>) -> IntTensor<Self> {
        let shape = a.shape.clone();
        record::<B>("kiln_trit_bind", vec![a, b], vec![shape], Op::Bind).remove(0)
    }

    fn trit_permute(words: IntTensor<Self>, len: usize, shift: usize) -> IntTensor<Self> {
        let shape = words.shape.clone();
        record::<B>("kiln_trit_permute", vec![words], vec![shape], Op::Permute { len, shift }).remove(0)
    }

    fn trit_bundle(words: IntTensor<Self>, len: usize, weights: Option<Vec<i32>>) -> IntTensor<Self> {
        record::<B>("kiln_trit_bundle", vec![words], vec![words_shape(1, len)], Op::Bundle { len, weights }).remove(0)
    }

    fn trit_scores(queries: IntTensor<Self>, memory: IntTensor<Self>, metric: Metric, pairwise: bool) -> IntTensor<Self> {
        let shape = if pairwise { Shape::new([memory.shape[0]]) } else { Shape::new([queries.shape[0], memory.shape[0]]) };
        record::<B>("kiln_trit_scores", vec![queries, memory], vec![shape], Op::Scores { metric, pairwise }).remove(0)
    }

    fn trit_topk(scores: IntTensor<Self>, k: usize, smallest: bool) -> (IntTensor<Self>, IntTensor<Self>) {
        let shape = Shape::new([scores.shape[0], k]);
        let [values, indices]: [_; 2] =
            record::<B>("kiln_trit_topk", vec![scores], vec![shape.clone(), shape], Op::Topk { k, smallest }).try_into().unwrap();
        (values, indices)
    }
}
