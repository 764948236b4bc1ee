//! Dense products under `Autodiff`. With `G = dOut`:
//! `d op(lhs) = s · G · op(rhs)ᵀ` and `d op(rhs) = s · op(lhs)ᵀ · G` (`s` the product's scale), each one more product through the
//! same backend op with transpose flags (no transposed copies); `d bias = Σ_rows G`,
//! `d residual = G`. A shared (batch-1) operand's gradient is summed over the batch. The gradient
//! products read the saved operands and `G` through rank-3 views and return each operand's own
//! shape, so under fusion the backward records no reshape operations around them either.
//!
//! An operand whose gradient another consumer has already registered (the input of a LoRA layer,
//! of q/k/v or gate/up projections) gets its share added in the product's epilogue (cuBLASLt's
//! `C`) instead of by `Gradients::register`'s separate add: one pass over the gradient instead of
//! three.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{DType, Shape, TensorMetadata, backend::Backend, ops::FloatTensor};

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

/// One operand's gradient `scale · op(a) · op(b) + prior` (views `a_view`, `b_view` of the tensors
/// given), in the operand's own `shape`: the views and the reshape back happen inside the backend
/// op, as in the forward, and `prior` (a gradient registered earlier) is the product's residual.
/// An operand shared by every batch (view batch 1 against a larger product batch) gets the
/// `[batch, r, c]` product summed over the batch.
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
    prior: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let product = GemmViews::rank3(a_view.clone(), b_view.clone(), layout).out;
    let views = |out| GemmViews::new(a_view.clone(), b_view.clone(), out, layout).scaled(scale);
    if operand_view[0] == 1 && product[0] != 1 {
        let summed = B::float_reshape(B::float_sum_dim(B::gemm(a, b, None, None, views(product)), 0), shape);
        match prior {
            Some(prior) => B::float_add(summed, prior),
            None => summed,
        }
    } else {
        B::gemm(a, b, None, prior, views(shape))
    }
}

/// `d lhs` for `out = op(lhs) · op(rhs)`, with `g` the output gradient (shape `views.out`, viewed
/// as the `[batch, m, n]` product), in the operand's own shape, plus `prior`.
fn lhs_grad<B: MatmulBackend>(s: &Saved<B>, g: FloatTensor<B>, prior: Option<FloatTensor<B>>) -> FloatTensor<B> {
    let (v, rhs) = (&s.views, s.rhs.clone());
    let (tl, tr) = (v.layout.transpose_lhs, v.layout.transpose_rhs);
    let shape = s.lhs.shape();
    if tl {
        operand_grad::<B>(rhs, &v.rhs, g, &v.product(), GemmLayout::new(tr, true), v.scale, &v.lhs, shape, prior)
    } else {
        operand_grad::<B>(g, &v.product(), rhs, &v.rhs, GemmLayout::new(false, !tr), v.scale, &v.lhs, shape, prior)
    }
}

/// `d rhs`, as [`lhs_grad`].
fn rhs_grad<B: MatmulBackend>(s: &Saved<B>, g: FloatTensor<B>, prior: Option<FloatTensor<B>>) -> FloatTensor<B> {
    let (v, lhs) = (&s.views, s.lhs.clone());
    let (tl, tr) = (v.layout.transpose_lhs, v.layout.transpose_rhs);
    let shape = s.rhs.shape();
    if tr {
        operand_grad::<B>(g, &v.product(), lhs, &v.lhs, GemmLayout::new(true, tl), v.scale, &v.rhs, shape, prior)
    } else {
        operand_grad::<B>(lhs, &v.lhs, g, &v.product(), GemmLayout::new(!tl, false), v.scale, &v.rhs, shape, prior)
    }
}

/// A throwaway tensor like `like` (a primitive of the inner backend `$b`) given `node`: how
/// [`take_prior`] finds a registered gradient (a macro: burn-autodiff names no node type outside
/// itself).
macro_rules! probe {
    ($b:ty, $node:expr, $like:expr) => {{
        let mut probe = <burn::backend::autodiff::Autodiff<$b> as burn::tensor::backend::AutodiffBackend>::from_inner($like.clone());
        probe.node = $node;
        probe
    }};
}
pub(crate) use probe;

/// `Σ_rows g` of a `[rows, n]`-viewed output gradient: a bias's gradient `[n]`.
pub(crate) fn bias_grad<B: Backend>(g: FloatTensor<B>, rows: usize, n: usize) -> FloatTensor<B> {
    let flat = B::float_reshape(g, Shape::new([rows, n]));
    B::float_reshape(B::float_sum_dim(flat, 0), Shape::new([n]))
}

/// The gradient `grads` already holds for `probe`'s node, taken out so that the next product adds
/// it in its epilogue; `None`, and nothing taken, unless it has `shape` and `dtype`.
///
/// burn-autodiff offers no test for a registered gradient short of `Gradients::remove`, which
/// takes a tensor, and names no node type outside itself: `probe` is a throwaway tensor given the
/// node. `KILN_GEMM_GRAD_PRIOR=0` leaves every prior to `register`, for measuring the difference.
pub(crate) fn take_prior<B: Backend>(grads: &mut Gradients, probe: &FloatTensor<Autodiff<B>>, shape: &Shape, dtype: DType) -> Option<FloatTensor<B>> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("KILN_GEMM_GRAD_PRIOR").is_ok_and(|v| v == "0")) {
        return None;
    }
    let prior = grads.remove::<B>(probe)?;
    if prior.shape() == *shape && prior.dtype() == dtype {
        Some(prior)
    } else {
        grads.register::<B>(probe.node.id, prior);
        None
    }
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
            grads.register::<B>(node.id, bias_grad::<B>(g.clone(), batch * rows, n));
        }
        if let Some(node) = residual_node {
            grads.register::<B>(node.id, g.clone());
        }
        // Each operand's gradient is computed, and registered, with whatever its node already
        // holds (an operand that is both lhs and rhs takes the first's share into the second).
        if let Some(node) = lhs_node {
            let probe = probe!(B, node, &s.lhs);
            let prior = take_prior::<B>(grads, &probe, &s.lhs.shape(), s.lhs.dtype());
            grads.register::<B>(probe.node.id, lhs_grad(&s, g.clone(), prior));
        }
        if let Some(node) = rhs_node {
            let probe = probe!(B, node, &s.rhs);
            let prior = take_prior::<B>(grads, &probe, &s.rhs.shape(), s.rhs.dtype());
            grads.register::<B>(probe.node.id, rhs_grad(&s, g, prior));
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
