//! LoRA's forward and backward as products and dropouts, written once for every path: the
//! backends' own (`Kernels::backend`) and the reference (`Kernels::reference`).

use burn::tensor::{Shape, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::{DropoutMask, ExpandSpec, LoraBackend, LoraGrads, LoraLinearGrads, LoraSpec};
use crate::ops::matmul::{GemmLayout, GemmViews};
use crate::ops::nf4::Quantized4Primitive;

/// A product `lhs · rhs` with an optional bias and residual, as [`crate::ops::matmul::MatmulBackend::gemm`].
pub(super) type Gemm<B> = fn(FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>, Option<FloatTensor<B>>, GemmViews) -> FloatTensor<B>;
type Dropout<B> = fn(FloatTensor<B>, DropoutMask) -> FloatTensor<B>;
type DyProducts<B> = fn(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, [f32; 2]) -> (FloatTensor<B>, FloatTensor<B>);
type Expand<B> = fn(FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>, ExpandSpec, Shape) -> FloatTensor<B>;

/// The primitives the update is made of: a product (with an optional bias and residual), the dropout, the
/// backward's pair of products that read `dy` ([`LoraBackend::lora_dy_products`]) and the products
/// that expand a rank-r operand to the full width ([`LoraBackend::lora_expand`]).
pub(super) struct Kernels<B: Backend> {
    gemm: Gemm<B>,
    dropout: Dropout<B>,
    dy_products: DyProducts<B>,
    expand: Expand<B>,
}

/// A product (with an optional bias and residual) through Burn's matmul.
fn reference_gemm<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>, bias: Option<FloatTensor<B>>, residual: Option<FloatTensor<B>>, views: GemmViews) -> FloatTensor<B> {
    crate::ops::matmul::reference::gemm::<B>(lhs, rhs, bias, residual, &views)
}

impl<B: LoraBackend> Kernels<B> {
    /// The backend's products, dropout and `dy` pair.
    pub(super) fn backend() -> Self {
        Self { gemm: B::gemm, dropout: B::lora_dropout, dy_products: B::lora_dy_products, expand: B::lora_expand }
    }
}

impl<B: Backend> Kernels<B> {
    /// Burn's matmul and the host-built mask.
    pub(super) fn reference() -> Self {
        Self {
            gemm: reference_gemm::<B>,
            dropout: super::reference::dropout::<B>,
            dy_products: |dy, h, b, scales| dy_products::<B>(reference_gemm::<B>, dy, h, b, scales),
            expand: |lhs, rhs, residual, spec, out| expand::<B>(reference_gemm::<B>, super::reference::dropout::<B>, lhs, rhs, residual, spec, out),
        }
    }

    fn dropout(&self, x: FloatTensor<B>, spec: &LoraSpec) -> FloatTensor<B> {
        match spec.dropout {
            Some(mask) => (self.dropout)(x, mask),
            None => x,
        }
    }
}

/// `[rows, in, r, out]` of an update: `x` `[.., in]`, `a` `[r, in]`, `b` `[out, r]`.
fn dims<B: Backend>(x: &FloatTensor<B>, a: &FloatTensor<B>, b: &FloatTensor<B>) -> [usize; 4] {
    let (xs, a_shape, b_shape) = (x.shape(), a.shape(), b.shape());
    let d_in = xs[xs.num_dims() - 1];
    [xs.num_elements() / d_in.max(1), d_in, a_shape[0], b_shape[0]]
}

fn views(lhs: [usize; 3], rhs: [usize; 3], out: Shape, transpose_lhs: bool, transpose_rhs: bool) -> GemmViews {
    GemmViews::new(Shape::new(lhs), Shape::new(rhs), out, GemmLayout::new(transpose_lhs, transpose_rhs))
}

/// `(base + s · h · Bᵀ, h)` with `h = dropout(x) · Aᵀ`.
pub(super) fn forward<B: Backend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    base: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    spec: LoraSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let out = base.shape();
    let h = factor(k, x, a, &spec, 1.0);
    let y = (k.expand)(h.clone(), b, Some(base), ExpandSpec { rhs_transposed: true, scale: spec.scale, dropout: None }, out);
    (y, h)
}

/// `scale · dropout(x) · Aᵀ` (`[rows, r]`): the update's rank-r factor, which [`forward`] keeps
/// unscaled and a LoRA layer over a float base scaled by `s` ([`scaled_factor`]).
fn factor<B: Backend>(k: &Kernels<B>, x: FloatTensor<B>, a: FloatTensor<B>, spec: &LoraSpec, scale: f32) -> FloatTensor<B> {
    let ([r, d_in], x_shape) = (a.shape().dims(), x.shape());
    let rows = x_shape.num_elements() / d_in.max(1);
    (k.gemm)(k.dropout(x, spec), a, None, None, views([1, rows, d_in], [1, r, d_in], Shape::new([rows, r]), false, true).scaled(scale))
}

/// `s · dropout(x) · Aᵀ` (`[rows, r]`): the update's rank-r factor, scaled, which a LoRA layer
/// over a float base keeps for its backward.
pub(super) fn scaled_factor<B: Backend>(k: &Kernels<B>, x: FloatTensor<B>, a: FloatTensor<B>, spec: &LoraSpec) -> FloatTensor<B> {
    factor(k, x, a, spec, spec.scale)
}

/// `x`'s shape with its last axis `width`: a layer's output shape.
pub(super) fn with_last(shape: Shape, width: usize) -> Shape {
    let mut dims = shape.as_slice().to_vec();
    let last = dims.len() - 1;
    dims[last] = width;
    Shape::from(dims)
}

/// `(x · W + bias + hs · Bᵀ, hs)` with `hs` the [`scaled_factor`]: a LoRA layer over a float base
/// (`W` `[in, out]`), as the base's product with its bias and the update's product with that as
/// its residual.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_forward<B: Backend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    spec: LoraSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let [rows, d_in, _, d_out] = dims::<B>(&x, &a, &b);
    let out = with_last(x.shape(), d_out);
    layer_forward(k, x, a, b, spec, |x| (k.gemm)(x, w, bias, None, views([1, rows, d_in], [1, d_in, d_out], out, false, false)))
}

/// [`linear_forward`] over a 4-bit `[out, in]` weight: the base's product by the backend's
/// [`Nf4Backend::matmul_4bit`](crate::ops::nf4::Nf4Backend::matmul_4bit), then its bias.
pub(super) fn linear_4bit_forward<B: LoraBackend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    w: Quantized4Primitive<B>,
    bias: Option<FloatTensor<B>>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    spec: LoraSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let [rows, d_in, _, d_out] = dims::<B>(&x, &a, &b);
    let out = with_last(x.shape(), d_out);
    layer_forward(k, x, a, b, spec, |x| {
        let y = B::matmul_4bit(B::float_reshape(x, Shape::new([rows, d_in])), w);
        let y = match bias {
            Some(bias) => B::float_add(y, B::float_reshape(bias, Shape::new([1, d_out]))),
            None => y,
        };
        B::float_reshape(y, out)
    })
}

/// `(base(x) + hs · Bᵀ, hs)`: the update's scaled factor, then its product with the base's
/// output (in the layer's output shape, its bias added) as the residual.
fn layer_forward<B: Backend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    spec: LoraSpec,
    base: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let out = with_last(x.shape(), b.shape()[0]);
    let hs = scaled_factor(k, x.clone(), a, &spec);
    let y = (k.expand)(hs.clone(), b, Some(base(x)), ExpandSpec { rhs_transposed: true, scale: 1.0, dropout: None }, out);
    (y, hs)
}

/// `dropout(s · lhs · op(rhs)) + residual` ([`LoraBackend::lora_expand`]) as a product of `gemm`,
/// then the dropout and an add where there is a dropout.
pub(super) fn expand<B: Backend>(
    gemm: Gemm<B>,
    dropout: Dropout<B>,
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    residual: Option<FloatTensor<B>>,
    spec: ExpandSpec,
    out: Shape,
) -> FloatTensor<B> {
    let ([rows, r], rhs_shape) = (lhs.shape().dims(), rhs.shape());
    let rhs_view = [1, rhs_shape[0], rhs_shape[1]];
    let views = views([1, rows, r], rhs_view, out, false, spec.rhs_transposed).scaled(spec.scale);
    match spec.dropout {
        None => gemm(lhs, rhs, None, residual, views),
        Some(mask) => {
            let dropped = dropout(gemm(lhs, rhs, None, None, views), mask);
            match residual {
                Some(residual) => B::float_add(dropped, residual),
                None => dropped,
            }
        }
    }
}

/// `(dh, dB) = (s_dh · dy · B, s_db · dyᵀ · h)` as two products of `gemm`: `dy` is `[.., out]`,
/// `h` `[rows, r]`, `b` `[out, r]`; `dh` is `[rows, r]`.
pub(super) fn dy_products<B: Backend>(gemm: Gemm<B>, dy: FloatTensor<B>, h: FloatTensor<B>, b: FloatTensor<B>, [scale_dh, scale_db]: [f32; 2]) -> (FloatTensor<B>, FloatTensor<B>) {
    let (h_shape, d_out) = (h.shape(), b.shape()[0]);
    let (rows, r) = (h_shape[0], h_shape[1]);
    let dh = gemm(dy.clone(), b, None, None, views([1, rows, d_out], [1, d_out, r], Shape::new([rows, r]), false, false).scaled(scale_dh));
    let db = gemm(dy, h, None, None, views([1, rows, d_out], [1, rows, r], Shape::new([d_out, r]), true, false).scaled(scale_db));
    (dh, db)
}

/// `(dh, dA, dB)`: the rank-r products `dh = s · dy · B` and `dB = s_db · dyᵀ · h` first (one
/// pass over `dy` where the backend fuses them), then `dA = dhᵀ · dropout(x)`, taken as
/// `(dropout(x)ᵀ · dh)ᵀ`, a product of `in` rows: with `r` rows it went to the skinny kernel (after
/// a copy of `dhᵀ`), at half cuBLASLt's speed over the tokens (31.7 against ~15.6 µs at 4096 ×
/// 4096, rank 16, H100; 28th session, call C). `s_db` is `s`, or 1 where `h` is already scaled.
pub(super) fn rank_grads<B: Backend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    h: FloatTensor<B>,
    b: FloatTensor<B>,
    dy: FloatTensor<B>,
    spec: &LoraSpec,
    scale_db: f32,
) -> [FloatTensor<B>; 3] {
    let ([rows, r], d_in) = (h.shape().dims(), x.shape()[x.shape().num_dims() - 1]);
    let (dh, db) = (k.dy_products)(dy, h, b, [spec.scale, scale_db]);
    let da_t = (k.gemm)(k.dropout(x, spec), dh.clone(), None, None, views([1, rows, d_in], [1, rows, r], Shape::new([d_in, r]), true, false));
    [dh, B::float_transpose(da_t), db]
}

/// `dx = dropout(s · dy · B · A) + prior`, `dA = (s · dy · B)ᵀ · dropout(x)`, `dB = s · dyᵀ · h`
/// ([`rank_grads`] first); `prior`, a gradient of `x` registered before, is the `dx` product's
/// residual.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<B: Backend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    h: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    dy: FloatTensor<B>,
    spec: LoraSpec,
    prior: Option<FloatTensor<B>>,
) -> LoraGrads<FloatTensor<B>> {
    let x_shape = x.shape();
    let [dh, da, db] = rank_grads(k, x, h, b, dy, &spec, spec.scale);
    let dx = (k.expand)(dh, a, prior, ExpandSpec { rhs_transposed: false, scale: 1.0, dropout: spec.dropout }, x_shape);
    LoraGrads { x: dx, a: da, b: db }
}

/// The gradients of [`linear_forward`]: `dx = dy · Wᵀ + dropout(dh · A) + prior` (when `want_dx`;
/// the update's share is the base product's residual), `dA`, and `dB = dyᵀ · hs` ([`rank_grads`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_backward<B: Backend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    hs: FloatTensor<B>,
    w: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    dy: FloatTensor<B>,
    spec: LoraSpec,
    prior: Option<FloatTensor<B>>,
    want_dx: bool,
) -> LoraLinearGrads<FloatTensor<B>> {
    let [rows, d_in, _, d_out] = dims::<B>(&x, &a, &b);
    let base_dx = |dy, update, x_shape| (k.gemm)(dy, w, None, Some(update), views([1, rows, d_out], [1, d_in, d_out], x_shape, false, true));
    layer_backward(k, x, hs, a, b, dy, spec, prior, want_dx.then_some(base_dx))
}

/// [`linear_backward`] over a 4-bit `[out, in]` weight: the base's share of `dx` by the backend's
/// [`Nf4Backend::matmul_4bit_input_grad`](crate::ops::nf4::Nf4Backend::matmul_4bit_input_grad),
/// added to the update's.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_4bit_backward<B: LoraBackend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    hs: FloatTensor<B>,
    w: Quantized4Primitive<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    dy: FloatTensor<B>,
    spec: LoraSpec,
    prior: Option<FloatTensor<B>>,
    want_dx: bool,
) -> LoraLinearGrads<FloatTensor<B>> {
    let [rows, _, _, d_out] = dims::<B>(&x, &a, &b);
    let base_dx = |dy, update, x_shape| B::float_add(B::float_reshape(B::matmul_4bit_input_grad(B::float_reshape(dy, Shape::new([rows, d_out])), w), x_shape), update);
    layer_backward(k, x, hs, a, b, dy, spec, prior, want_dx.then_some(base_dx))
}

/// [`rank_grads`] (with `hs`, the scaled factor), then, given `base_dx`, `dx` as the base's input
/// gradient of `dy` with the update's share `dropout(dh · A) + prior` (its second argument) in it,
/// in `x`'s shape (its third).
#[allow(clippy::too_many_arguments)]
fn layer_backward<B: Backend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    hs: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    dy: FloatTensor<B>,
    spec: LoraSpec,
    prior: Option<FloatTensor<B>>,
    base_dx: Option<impl FnOnce(FloatTensor<B>, FloatTensor<B>, Shape) -> FloatTensor<B>>,
) -> LoraLinearGrads<FloatTensor<B>> {
    let x_shape = x.shape();
    let [dh, da, db] = rank_grads(k, x, hs, b, dy.clone(), &spec, 1.0);
    let dx = base_dx.map(|base_dx| {
        let update = (k.expand)(dh, a, prior, ExpandSpec { rhs_transposed: false, scale: 1.0, dropout: spec.dropout }, x_shape.clone());
        base_dx(dy, update, x_shape)
    });
    LoraLinearGrads { x: dx, a: da, b: db }
}
