//! The chunk loop, generic over the backend's products and cross-entropy kernels: per chunk of
//! rows the logits, their losses and, when gradients are wanted, the logits' gradient and its two
//! products, after which the chunk's logits and gradient are dropped.

use burn::tensor::{Bool, Int, Shape, Tensor, TensorMetadata, backend::Backend, ops::{FloatTensor, IntTensor}};

use super::{LinearCrossEntropyOptions, Reduction, default_chunk_rows};
use crate::ops::cross_entropy::CrossEntropyBackend;
use crate::ops::matmul::{GemmLayout, GemmViews, MatmulBackend};
use crate::ops::{compute_dtype, prim, wrap};

/// Which gradients the forward takes.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Wanted {
    pub hidden: bool,
    pub weight: bool,
}

/// The reduced loss `[1]` and the gradients asked for, for a loss gradient of 1.
pub(super) struct Output<T> {
    pub loss: T,
    pub hidden: Option<T>,
    pub weight: Option<T>,
}

fn views(lhs: [usize; 2], rhs: [usize; 2], out: [usize; 2], layout: GemmLayout) -> GemmViews {
    GemmViews::new(Shape::new([1, lhs[0], lhs[1]]), Shape::new([1, rhs[0], rhs[1]]), Shape::new(out), layout)
}

/// `1 / max(counted rows, 1)` for the mean, 1 for the sum: `[1]` in `like`'s compute dtype.
pub(super) fn reduction_weight<B: Backend>(targets: &Tensor<B, 1, Int>, reduction: Reduction, like: &FloatTensor<B>) -> Tensor<B, 1> {
    let counted: Tensor<B, 1, Bool> = targets.clone().greater_equal_elem(0);
    let count = counted.float().cast(compute_dtype(like.dtype())).sum();
    match reduction {
        Reduction::Mean => count.clamp_min(1.0).recip(),
        Reduction::Sum => count.ones_like(),
    }
}

pub(super) fn run<B: MatmulBackend + CrossEntropyBackend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    options: LinearCrossEntropyOptions,
    wanted: Wanted,
) -> Output<FloatTensor<B>> {
    let ([rows, d], vocab) = (hidden.shape().dims(), weight.shape()[1]);
    let chunk = options.chunk_rows.unwrap_or_else(|| default_chunk_rows(rows, vocab, hidden.dtype().size(), wanted.weight));
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let g = reduction_weight(&targets, options.reduction, &hidden);
    let hidden = wrap::<B, 2>(hidden);
    let mut losses = Vec::new();
    let mut dhidden = Vec::new();
    let mut dweight: Option<FloatTensor<B>> = None;
    for range in (0..rows).step_by(chunk).map(|start| start..(start + chunk).min(rows)) {
        let n = range.len();
        let h = prim(hidden.clone().slice([range.clone()]));
        let t = targets.clone().slice([range.clone()]).into_primitive();
        let logits = B::gemm(h.clone(), weight.clone(), None, None, views([n, d], [d, vocab], [n, vocab], GemmLayout::new(false, false)));
        let (loss, lse) = B::cross_entropy_forward(logits.clone(), t.clone());
        losses.push(loss);
        if !(wanted.hidden || wanted.weight) {
            continue;
        }
        let dlogits = B::cross_entropy_backward(logits, t, lse, prim(g.clone().expand([n])));
        if wanted.hidden {
            dhidden.push(B::gemm(dlogits.clone(), weight.clone(), None, None, views([n, vocab], [d, vocab], [n, d], GemmLayout::new(false, true))));
        }
        if wanted.weight {
            dweight = Some(B::gemm(h, dlogits, None, dweight, views([n, d], [n, vocab], [d, vocab], GemmLayout::new(true, false))));
        }
    }
    let loss = wrap::<B, 1>(cat::<B>(losses)).sum() * g;
    Output { loss: prim(loss), hidden: wanted.hidden.then(|| cat::<B>(dhidden)), weight: dweight }
}

/// The chunks' results joined along rows (one chunk: itself; there is at least one row).
fn cat<B: MatmulBackend>(mut parts: Vec<FloatTensor<B>>) -> FloatTensor<B> {
    if parts.len() == 1 { parts.remove(0) } else { B::float_cat(parts, 0) }
}
