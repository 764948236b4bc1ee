//! Packed trits under `Autodiff<B>`: integers carry no gradient, so every op is the inner
//! backend's (an int tensor of `Autodiff<B>` is `B`'s).

use burn::backend::autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};
use burn::tensor::ops::IntTensor;

use super::{Metric, TritBackend};

impl<B: TritBackend, C: CheckpointStrategy> TritBackend for Autodiff<B, C> {
    fn trit_pack(trits: IntTensor<Self>) -> IntTensor<Self> {
        B::trit_pack(trits)
    }

    fn trit_unpack(words: IntTensor<Self>, len: usize) -> IntTensor<Self> {
        B::trit_unpack(words, len)
    }

    fn trit_random(rows: usize, len: usize, seed: u64, threshold: u32, device: &Self::Device) -> IntTensor<Self> {
        B::trit_random(rows, len, seed, threshold, device)
    }

    fn trit_bind(a: IntTensor<Self>, b: IntTensor<Self>) -> IntTensor<Self> {
        B::trit_bind(a, b)
    }

    fn trit_permute(words: IntTensor<Self>, len: usize, shift: usize) -> IntTensor<Self> {
        B::trit_permute(words, len, shift)
    }

    fn trit_bundle(words: IntTensor<Self>, len: usize, weights: Option<Vec<i32>>) -> IntTensor<Self> {
        B::trit_bundle(words, len, weights)
    }

    fn trit_scores(queries: IntTensor<Self>, memory: IntTensor<Self>, metric: Metric, pairwise: bool) -> IntTensor<Self> {
        B::trit_scores(queries, memory, metric, pairwise)
    }

    fn trit_topk(scores: IntTensor<Self>, k: usize, smallest: bool) -> (IntTensor<Self>, IntTensor<Self>) {
        B::trit_topk(scores, k, smallest)
    }
}
