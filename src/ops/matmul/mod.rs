//! Dense matrix products — `matmul`, and `linear` (`x · W + b`, Burn's `[in, out]` weight) with
//! bias and residual epilogues — through the fastest correct path of each backend:
//! cuBLASLt on CUDA (called on CubeCL's own device memory, see `cublaslt.rs`), Burn's autotuned
//! matmul elsewhere. Forward and both backward products (dX, dW) take the same path.

mod backward;
pub(crate) use backward::{bias_grad, probe, take_prior};
#[cfg(feature = "cuda")]
mod cublaslt;
#[cfg(feature = "cuda")]
mod cubecl_stream;
mod cube;
mod fusion;
pub mod reference;
#[cfg(feature = "cuda")]
pub(crate) mod stream_order;
#[cfg(feature = "cuda")]
mod tuning;

#[cfg(feature = "cuda")]
pub use cublaslt::{cublaslt_stream_order, cublaslt_synchronize};
#[cfg(feature = "cuda")]
pub use stream_order::StreamOrder;
#[cfg(feature = "cuda")]
pub(crate) use cube::gemm_i8;

use burn::tensor::{Shape, Tensor, backend::Backend, ops::FloatTensor};

use super::{prim, wrap};
use crate::error::{ensure, ensure_float, ensure_same_dtype};

/// Whether each operand is read transposed (its last two axes swapped).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GemmLayout {
    pub transpose_lhs: bool,
    pub transpose_rhs: bool,
}

impl GemmLayout {
    pub const fn new(transpose_lhs: bool, transpose_rhs: bool) -> Self {
        Self { transpose_lhs, transpose_rhs }
    }
}

/// How [`MatmulBackend::gemm`] reads its operands: the transpose flags, the `[batch, rows, cols]`
/// view of each operand (a row-major reshape of the tensor as given, which may have any rank) and
/// the shape of the output as returned (the `[batch, m, n]` product reshaped; a residual has this
/// shape too), and the factor the product is scaled by before its bias and residual are added
/// (BLAS's alpha: LoRA's `s · h · Bᵀ + base` is one product with it). The reshapes happen inside the op because under Burn's fusion every reshape outside
/// it is one more recorded operation (~5 µs of host time each on the H100 machine,
/// `benches/RESULTS.md` 2026-11-24), which at small products is a large part of the call.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmViews {
    pub layout: GemmLayout,
    pub lhs: Shape,
    pub rhs: Shape,
    pub out: Shape,
    pub scale: f32,
}

impl GemmViews {
    /// Rank-3 operands whose output is the `[batch, m, n]` product itself.
    pub(crate) fn rank3(lhs: Shape, rhs: Shape, layout: GemmLayout) -> Self {
        let out = output_shape(&lhs, &rhs, layout).unwrap_or_else(|| panic!("kiln::matmul: operands {lhs:?} and {rhs:?} do not fit ({layout:?})"));
        Self { layout, lhs, rhs, out, scale: 1.0 }
    }

    /// Views of an unscaled product.
    pub fn new(lhs: Shape, rhs: Shape, out: Shape, layout: GemmLayout) -> Self {
        Self { layout, lhs, rhs, out, scale: 1.0 }
    }

    /// The same views with the product scaled by `scale`.
    pub fn scaled(self, scale: f32) -> Self {
        Self { scale, ..self }
    }

    /// The `[batch, m, n]` shape of the product.
    pub(crate) fn product(&self) -> Shape {
        output_shape(&self.lhs, &self.rhs, self.layout)
            .filter(|p| p.num_elements() == self.out.num_elements())
            .unwrap_or_else(|| panic!("kiln::matmul: views {:?} and {:?} do not give the output {:?} ({:?})", self.lhs, self.rhs, self.out, self.layout))
    }
}

/// `lhs` and `rhs` reshaped to their views, `residual` to the `[batch, m, n]` product.
pub(crate) fn viewed<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    residual: Option<FloatTensor<B>>,
    views: &GemmViews,
) -> (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) {
    let product = views.product();
    (B::float_reshape(lhs, views.lhs.clone()), B::float_reshape(rhs, views.rhs.clone()), residual.map(|r| B::float_reshape(r, product)))
}

/// Backend support for dense products. The default method is the reference (Burn's matmul).
pub trait MatmulBackend: Backend {
    /// `out[b] = scale · op(lhs[b]) · op(rhs[b]) + bias + residual[b]` on the operands' rank-3 views
    /// (`[batch, rows, cols]`, see [`GemmViews`]), returned in the shape `views.out`; an operand
    /// with batch 1 is shared by every batch. `bias` is `[n]`, `residual` has the shape
    /// `views.out`.
    fn gemm(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        residual: Option<FloatTensor<Self>>,
        views: GemmViews,
    ) -> FloatTensor<Self> {
        reference::gemm::<Self>(lhs, rhs, bias, residual, &views)
    }
}

crate::backend::reference_backends!(MatmulBackend);

/// The `[batch, m, n]` output shape of a rank-3 product, `None` if the operands do not fit.
pub(crate) fn output_shape(lhs: &Shape, rhs: &Shape, layout: GemmLayout) -> Option<Shape> {
    let (m, k) = if layout.transpose_lhs { (lhs[2], lhs[1]) } else { (lhs[1], lhs[2]) };
    let (k2, n) = if layout.transpose_rhs { (rhs[2], rhs[1]) } else { (rhs[1], rhs[2]) };
    let batch = match (lhs[0], rhs[0]) {
        (a, b) if a == b => a,
        (1, b) => b,
        (a, 1) => a,
        _ => return None,
    };
    (k == k2).then(|| Shape::new([batch, m, n]))
}

/// `lhs · rhs` over the last two axes. Leading (batch) axes must be equal, or all 1 on one side
/// (that operand is shared); `[.., m, k] · [k, n]`-style products with a shared right operand run as
/// one `[(batch·m), k] · [k, n]` product.
///
/// # Panics
/// If the ranks are below 2, the inner dimensions differ, the batch axes do not fit, or the dtypes
/// differ or are not float.
pub fn matmul<B: MatmulBackend, const D: usize>(lhs: Tensor<B, D>, rhs: Tensor<B, D>) -> Tensor<B, D> {
    const OP: &str = "matmul";
    let (ls, rs) = (lhs.shape(), rhs.shape());
    ensure(D >= 2, OP, || format!("operands must have rank ≥ 2, got {:?} and {:?}", ls.as_slice(), rs.as_slice()));
    ensure_float(OP, "lhs", lhs.dtype());
    ensure_same_dtype(OP, &[("lhs", lhs.dtype()), ("rhs", rhs.dtype())]);
    let (m, k, k2, n) = (ls[D - 2], ls[D - 1], rs[D - 2], rs[D - 1]);
    ensure(k == k2, OP, || format!("inner dimensions differ: lhs {:?}, rhs {:?}", ls.as_slice(), rs.as_slice()));
    let (lb, rb) = (&ls.as_slice()[..D - 2], &rs.as_slice()[..D - 2]);
    let (l_batch, r_batch) = (lb.iter().product::<usize>(), rb.iter().product::<usize>());
    ensure(lb == rb || l_batch == 1 || r_batch == 1, OP, || {
        format!("batch axes must be equal or all 1 on one side: lhs {:?}, rhs {:?}", ls.as_slice(), rs.as_slice())
    });
    let mut out_dims = if l_batch >= r_batch { lb.to_vec() } else { rb.to_vec() };
    out_dims.extend([m, n]);
    let (lhs_view, rhs_view) = if r_batch == 1 {
        // A shared right operand: fold the left batch into its rows (one large product).
        ([1, l_batch * m, k], [1, k, n])
    } else {
        ([l_batch, m, k], [r_batch, k, n])
    };
    let views = GemmViews::new(Shape::new(lhs_view), Shape::new(rhs_view), Shape::from(out_dims), GemmLayout::default());
    wrap(B::gemm(prim(lhs), prim(rhs), None, None, views))
}

/// `x · weight + bias` over the last axis of `x`, with `weight` in Burn's `[d_input, d_output]`
/// layout (the layout of `burn::nn::Linear`); the bias is added in the product's epilogue.
///
/// # Panics
/// If `x`'s last axis is not `d_input`, the bias is not `[d_output]`, or the dtypes differ.
pub fn linear<B: MatmulBackend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Tensor<B, D> {
    linear_epilogue("linear", x, weight, bias, None)
}

/// `x · weight + bias + residual` — the output projection of a transformer block with its
/// residual connection — with the bias and the residual added in the product's epilogue.
///
/// # Panics
/// As [`linear`], and if `residual` does not have the output's shape.
pub fn linear_residual<B: MatmulBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    residual: Tensor<B, D>,
) -> Tensor<B, D> {
    linear_epilogue("linear_residual", x, weight, bias, Some(residual))
}

fn linear_epilogue<B: MatmulBackend, const D: usize>(
    op: &str,
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    residual: Option<Tensor<B, D>>,
) -> Tensor<B, D> {
    let (xs, ws) = (x.shape(), weight.shape());
    let (d_in, d_out) = (ws[0], ws[1]);
    ensure(D >= 1 && xs[D - 1] == d_in, op, || {
        format!("x {:?} must end in d_input = {d_in} of weight {:?} ([d_input, d_output])", xs.as_slice(), ws.as_slice())
    });
    ensure_float(op, "x", x.dtype());
    let mut dtypes = vec![("x", x.dtype()), ("weight", weight.dtype())];
    if let Some(b) = &bias {
        ensure(b.shape()[0] == d_out, op, || format!("bias {:?} must be [d_output] = [{d_out}]", b.shape().as_slice()));
        dtypes.push(("bias", b.dtype()));
    }
    let mut out_dims = xs.as_slice().to_vec();
    out_dims[D - 1] = d_out;
    if let Some(r) = &residual {
        ensure(r.shape().as_slice() == out_dims.as_slice(), op, || {
            format!("residual {:?} must have the output's shape {out_dims:?}", r.shape().as_slice())
        });
        dtypes.push(("residual", r.dtype()));
    }
    ensure_same_dtype(op, &dtypes);
    let rows = xs.num_elements() / d_in.max(1);
    let views = GemmViews::new(Shape::new([1, rows, d_in]), Shape::new([1, d_in, d_out]), Shape::from(out_dims), GemmLayout::default());
    wrap(B::gemm(prim(x), prim(weight), bias.map(prim), residual.map(prim), views))
}
