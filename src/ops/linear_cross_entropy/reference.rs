//! The fused linear cross-entropy from plain Burn ops: the whole logits, then the reference
//! cross-entropy, reduced.

use burn::tensor::{Int, Tensor, backend::Backend, ops::{FloatTensor, IntTensor}};

use super::Reduction;
use super::chunks::reduction_weight;
use crate::ops::{cross_entropy, prim, wrap};

pub fn loss<B: Backend>(hidden: FloatTensor<B>, weight: FloatTensor<B>, targets: IntTensor<B>, reduction: Reduction) -> FloatTensor<B> {
    let g = reduction_weight(&Tensor::<B, 1, Int>::from_primitive(targets.clone()), reduction, &hidden);
    let logits = wrap::<B, 2>(hidden).matmul(wrap(weight));
    let (losses, _) = cross_entropy::reference::forward::<B>(prim(logits), targets);
    prim(wrap::<B, 1>(losses).sum() * g)
}
