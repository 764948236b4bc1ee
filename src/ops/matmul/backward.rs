//! Dense products under `Autodiff`. With `G = dOut`:
//! `d op(lhs) = G · op(rhs)ᵀ` and `d op(rhs) = op(lhs)ᵀ · G`, each one more product through the
//! same backend op with transpose flags (no transposed copies); `d bias = Σ_rows G`,
//! `d residual = G`. A shared (batch-1) operand's gradient is summed over the batch. Gradients
//! are computed on the rank-3 views and reshaped back to each operand's own shape.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{Shape, TensorMetadata, ops::FloatTensor};

use super::{GemmLayout, GemmViews, MatmulBackend, viewed};

/// The node's parents are `lhs, rhs`, then `bias` and `residual` where present (`N` = 2..=4).
#[derive(Debug)]
struct GemmGrad<const N: usize>;

#[derive(Debug, Clone)]
struct Saved<B: MatmulBackend> {
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    views: GemmViews,
    bias: bool,
}

/// Sum a `[batch, r, c]` gradient over its batch when the operand it belongs to was shared.
fn unbroadcast<B: MatmulBackend>(grad: FloatTensor<B>, operand_batch: usize) -> FloatTensor<B> {
    if operand_batch == 1 && grad.shape()[0] != 1 { B::float_sum_dim(grad, 0) } else { grad }
}

/// A rank-3 product through the backend op.
fn product<B: MatmulBackend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>, layout: GemmLayout) -> FloatTensor<B> {
    let views = GemmViews::rank3(lhs.shape(), rhs.shape(), layout);
    B::gemm(lhs, rhs, None, None, views)
}

/// `(d lhs, d rhs)` for `out = op(lhs) · op(rhs)`, with `g` the `[batch, m, n]` output gradient,
/// in the operands' own shapes.
fn operand_grads<B: MatmulBackend>(s: &Saved<B>, g: FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let (tl, tr) = (s.views.layout.transpose_lhs, s.views.layout.transpose_rhs);
    let (lhs_shape, rhs_shape) = (s.lhs.shape(), s.rhs.shape());
    let (lhs, rhs, _) = viewed::<B>(s.lhs.clone(), s.rhs.clone(), None, &s.views);
    let d_lhs = if tl {
        product::<B>(rhs.clone(), g.clone(), GemmLayout::new(tr, true))
    } else {
        product::<B>(g.clone(), rhs.clone(), GemmLayout::new(false, !tr))
    };
    let d_rhs = if tr {
        product::<B>(g, lhs.clone(), GemmLayout::new(true, tl))
    } else {
        product::<B>(lhs.clone(), g, GemmLayout::new(!tl, false))
    };
    let d_lhs = unbroadcast::<B>(d_lhs, s.views.lhs[0]);
    let d_rhs = unbroadcast::<B>(d_rhs, s.views.rhs[0]);
    (B::float_reshape(d_lhs, lhs_shape), B::float_reshape(d_rhs, rhs_shape))
}

impl<B: MatmulBackend, const N: usize> Backward<B, N> for GemmGrad<N> {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let s = ops.state;
        let g = grads.consume::<B>(&ops.node);
        let g3 = B::float_reshape(g.clone(), s.views.product());
        let mut parents = ops.parents.into_iter();
        let (lhs_node, rhs_node) = (parents.next().flatten(), parents.next().flatten());
        let bias_node = if s.bias { parents.next().flatten() } else { None };
        let residual_node = parents.next().flatten();
        if let Some(node) = bias_node {
            let [batch, rows, n] = g3.shape().dims();
            let flat = B::float_reshape(g3.clone(), Shape::new([batch * rows, n]));
            grads.register::<B>(node.id, B::float_reshape(B::float_sum_dim(flat, 0), Shape::new([n])));
        }
        if let Some(node) = residual_node {
            grads.register::<B>(node.id, g.clone());
        }
        if lhs_node.is_some() || rhs_node.is_some() {
            let (d_lhs, d_rhs) = operand_grads::<B>(&s, g3);
            if let Some(node) = lhs_node {
                grads.register::<B>(node.id, d_lhs);
            }
            if let Some(node) = rhs_node {
                grads.register::<B>(node.id, d_rhs);
            }
        }
    }
}

/// Record the node with its parents (burn-autodiff's node type is not nameable outside it, so
/// this is a macro rather than a function generic over the parent count).
macro_rules! record {
    ($n:literal, $nodes:expr, $saved:expr, $out:expr) => {
        match GemmGrad::<$n>.prepare::<C>($nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish($saved, $out),
            OpsKind::UnTracked(prep) => prep.finish($out),
        }
    };
}

impl<B: MatmulBackend, C: CheckpointStrategy> MatmulBackend for Autodiff<B, C> {
    fn gemm(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        residual: Option<FloatTensor<Self>>,
        views: GemmViews,
    ) -> FloatTensor<Self> {
        let out = B::gemm(
            lhs.primitive.clone(),
            rhs.primitive.clone(),
            bias.as_ref().map(|b| b.primitive.clone()),
            residual.as_ref().map(|r| r.primitive.clone()),
            views.clone(),
        );
        let saved = Saved { lhs: lhs.primitive, rhs: rhs.primitive, views, bias: bias.is_some() };
        let (l, r) = (lhs.node, rhs.node);
        match (bias, residual) {
            (None, None) => record!(2, [l, r], saved, out),
            (Some(b), None) => record!(3, [l, r, b.node], saved, out),
            (None, Some(res)) => record!(3, [l, r, res.node], saved, out),
            (Some(b), Some(res)) => record!(4, [l, r, b.node, res.node], saved, out),
        }
    }
}
