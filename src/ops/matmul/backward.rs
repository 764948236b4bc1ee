//! Dense products under `Autodiff`. With `G = dOut`:
//! `d op(lhs) = s · G · op(rhs)ᵀ` and `d op(rhs) = s · op(lhs)ᵀ · G` (`s` the product's scale), each one more product through the
//! same backend op with transpose flags (no transposed copies); `d bias = Σ_rows G`,
//! `d residual = G`. A shared (batch-1) operand's gradient is summed over the batch. The gradient
//! products read the saved operands and `G` through rank-3 views and return each operand's own
//! shape, so under fusion the backward records no reshape operations around them either.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{Shape, TensorMetadata, ops::FloatTensor};

use super::{GemmLayout, GemmViews, MatmulBackend};

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

/// One operand's gradient `scale · op(a) · op(b)` (views `a_view`, `b_view` of the tensors given), in the
/// operand's own `shape`: the views and the reshape back happen inside the backend op, as in the
/// forward. An operand shared by every batch (view batch 1 against a larger product batch) gets
/// the `[batch, r, c]` product summed over the batch.
#[allow(clippy::too_many_arguments)]
fn operand_grad<B: MatmulBackend>(
    a: FloatTensor<B>,
    a_view: &Shape,
    b: FloatTensor<B>,
    b_view: &Shape,
    layout: GemmLayout,
    scale: f32,
    operand_view: &Shape,
    shape: Shape,
) -> FloatTensor<B> {
    let product = GemmViews::rank3(a_view.clone(), b_view.clone(), layout).out;
    let views = |out| GemmViews::new(a_view.clone(), b_view.clone(), out, layout).scaled(scale);
    if operand_view[0] == 1 && product[0] != 1 {
        let summed = B::float_sum_dim(B::gemm(a, b, None, None, views(product)), 0);
        B::float_reshape(summed, shape)
    } else {
        B::gemm(a, b, None, None, views(shape))
    }
}

/// `(d lhs, d rhs)` for `out = op(lhs) · op(rhs)`, with `g` the output gradient (shape
/// `views.out`, viewed as the `[batch, m, n]` product), in the operands' own shapes.
fn operand_grads<B: MatmulBackend>(s: &Saved<B>, g: FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let v = &s.views;
    let (tl, tr) = (v.layout.transpose_lhs, v.layout.transpose_rhs);
    let g_view = v.product();
    let (lhs, rhs) = (s.lhs.clone(), s.rhs.clone());
    let (lhs_shape, rhs_shape) = (lhs.shape(), rhs.shape());
    let d_lhs = if tl {
        operand_grad::<B>(rhs.clone(), &v.rhs, g.clone(), &g_view, GemmLayout::new(tr, true), v.scale, &v.lhs, lhs_shape)
    } else {
        operand_grad::<B>(g.clone(), &g_view, rhs, &v.rhs, GemmLayout::new(false, !tr), v.scale, &v.lhs, lhs_shape)
    };
    let d_rhs = if tr {
        operand_grad::<B>(g, &g_view, lhs, &v.lhs, GemmLayout::new(true, tl), v.scale, &v.rhs, rhs_shape)
    } else {
        operand_grad::<B>(lhs, &v.lhs, g, &g_view, GemmLayout::new(!tl, false), v.scale, &v.rhs, rhs_shape)
    };
    (d_lhs, d_rhs)
}

impl<B: MatmulBackend, const N: usize> Backward<B, N> for GemmGrad<N> {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let s = ops.state;
        let g = grads.consume::<B>(&ops.node);
        let mut parents = ops.parents.into_iter();
        let (lhs_node, rhs_node) = (parents.next().flatten(), parents.next().flatten());
        let bias_node = if s.bias { parents.next().flatten() } else { None };
        let residual_node = parents.next().flatten();
        if let Some(node) = bias_node {
            let [batch, rows, n] = s.views.product().dims();
            let flat = B::float_reshape(g.clone(), Shape::new([batch * rows, n]));
            grads.register::<B>(node.id, B::float_reshape(B::float_sum_dim(flat, 0), Shape::new([n])));
        }
        if let Some(node) = residual_node {
            grads.register::<B>(node.id, g.clone());
        }
        if lhs_node.is_some() || rhs_node.is_some() {
            let (d_lhs, d_rhs) = operand_grads::<B>(&s, g);
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
