//! LoRA's forward and backward as products and dropouts, written once for every path: the
//! backends' own (`Kernels::backend`) and the reference (`Kernels::reference`).

use burn::tensor::{Shape, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::{DropoutMask, LoraBackend, LoraGrads, LoraSpec};
use crate::ops::matmul::{GemmLayout, GemmViews, MatmulBackend};

type Gemm<B> = fn(FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>, Option<FloatTensor<B>>, GemmViews) -> FloatTensor<B>;
type Dropout<B> = fn(FloatTensor<B>, DropoutMask) -> FloatTensor<B>;
type DyProducts<B> = fn(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, f32) -> (FloatTensor<B>, FloatTensor<B>);

/// The primitives the update is made of: a product (with an optional bias and residual), the dropout, and
/// the backward's pair of products that read `dy` ([`LoraBackend::lora_dy_products`]).
pub(super) struct Kernels<B: Backend> {
    gemm: Gemm<B>,
    dropout: Dropout<B>,
    dy_products: DyProducts<B>,
}

/// A product (with an optional bias and residual) through Burn's matmul.
fn reference_gemm<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>, bias: Option<FloatTensor<B>>, residual: Option<FloatTensor<B>>, views: GemmViews) -> FloatTensor<B> {
    crate::ops::matmul::reference::gemm::<B>(lhs, rhs, bias, residual, &views)
}

impl<B: LoraBackend> Kernels<B> {
    /// The backend's products, dropout and `dy` pair.
    pub(super) fn backend() -> Self {
        Self { gemm: B::gemm, dropout: B::lora_dropout, dy_products: B::lora_dy_products }
    }
}

impl<B: Backend> Kernels<B> {
    /// Burn's matmul and the host-built mask.
    pub(super) fn reference() -> Self {
        Self { gemm: reference_gemm::<B>, dropout: super::reference::dropout::<B>, dy_products: |dy, h, b, scale| dy_products::<B>(reference_gemm::<B>, dy, h, b, scale) }
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

/// `(base + s · h · Bᵀ, h)` with `h = dropout(x) · Aᵀ`; without `base`, the update `s · h · Bᵀ`
/// alone (`x`'s leading axes, `out` columns).
pub(super) fn forward<B: Backend>(
    k: &Kernels<B>,
    x: FloatTensor<B>,
    base: Option<FloatTensor<B>>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    spec: LoraSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let [rows, d_in, r, d_out] = dims::<B>(&x, &a, &b);
    let out = with_last(x.shape(), d_out);
    let x = k.dropout(x, &spec);
    let h = (k.gemm)(x, a, None, None, views([1, rows, d_in], [1, r, d_in], Shape::new([rows, r]), false, true));
    let y = (k.gemm)(h.clone(), b, None, base, views([1, rows, r], [1, d_out, r], out, false, true).scaled(spec.scale));
    (y, h)
}

/// `x · W + bias + update`, the base product of [`LoraBackend::lora_linear`] (`W` `[in, out]`),
/// the update its residual.
pub(super) fn base_product<B: MatmulBackend>(x: FloatTensor<B>, weight: FloatTensor<B>, bias: Option<FloatTensor<B>>, update: Option<FloatTensor<B>>) -> FloatTensor<B> {
    let (x_shape, [d_in, d_out]) = (x.shape(), weight.shape().dims());
    let rows = x_shape.num_elements() / d_in.max(1);
    B::gemm(x, weight, bias, update, views([1, rows, d_in], [1, d_in, d_out], with_last(x_shape, d_out), false, false))
}

/// `dy · Wᵀ + share`, `x`'s gradient through [`base_product`] with the update's `share` (and any
/// gradient registered before it) as the product's residual.
pub(super) fn base_input_grad<B: MatmulBackend>(dy: FloatTensor<B>, weight: FloatTensor<B>, share: FloatTensor<B>) -> FloatTensor<B> {
    let (dy_shape, [d_in, d_out]) = (dy.shape(), weight.shape().dims());
    let rows = dy_shape.num_elements() / d_out.max(1);
    B::gemm(dy, weight, None, Some(share), views([1, rows, d_out], [1, d_in, d_out], with_last(dy_shape, d_in), false, true))
}

/// `shape` with its last axis `last`.
pub(super) fn with_last(mut shape: Shape, last: usize) -> Shape {
    let d = shape.num_dims();
    shape[d - 1] = last;
    shape
}

/// `(dh, dB) = (s · dy · B, s · dyᵀ · h)` as two products of `gemm`: `dy` is `[.., out]`, `h`
/// `[rows, r]`, `b` `[out, r]`; `dh` is `[rows, r]`.
pub(super) fn dy_products<B: Backend>(gemm: Gemm<B>, dy: FloatTensor<B>, h: FloatTensor<B>, b: FloatTensor<B>, scale: f32) -> (FloatTensor<B>, FloatTensor<B>) {
    let (h_shape, d_out) = (h.shape(), b.shape()[0]);
    let (rows, r) = (h_shape[0], h_shape[1]);
    let dh = gemm(dy.clone(), b, None, None, views([1, rows, d_out], [1, d_out, r], Shape::new([rows, r]), false, false).scaled(scale));
    let db = gemm(dy, h, None, None, views([1, rows, d_out], [1, rows, r], Shape::new([d_out, r]), true, false).scaled(scale));
    (dh, db)
}

/// `dx = dropout(s · dy · B · A) + prior`, `dA = (s · dy · B)ᵀ · dropout(x)`, `dB = s · dyᵀ · h`,
/// the rank-r products `dh = s · dy · B` and `dB` first (one pass over `dy` where the backend fuses
/// them). `prior`, a gradient of `x` another consumer registered, is the `dx` product's residual
/// (after the dropout, an add). `dA` is taken as `(dropout(x)ᵀ · dh)ᵀ`, a product of `in` rows:
/// with `r` rows it went to the skinny kernel (after a copy of `dhᵀ`), at half cuBLASLt's speed
/// over the tokens (31.7 against ~15.6 µs at 4096 × 4096, rank 16, H100; 28th session, call C).
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
    let [rows, d_in, r, _] = dims::<B>(&x, &a, &b);
    let x_shape = x.shape();
    let (dh, db) = (k.dy_products)(dy, h, b, spec.scale);
    let da_t = (k.gemm)(k.dropout(x, &spec), dh.clone(), None, None, views([1, rows, d_in], [1, rows, r], Shape::new([d_in, r]), true, false));
    let da = B::float_transpose(da_t);
    let dx_views = views([1, rows, r], [1, r, d_in], x_shape, false, false);
    let dx = match (spec.dropout, prior) {
        (None, prior) => (k.gemm)(dh, a, None, prior, dx_views),
        (Some(_), prior) => {
            let dx = k.dropout((k.gemm)(dh, a, None, None, dx_views), &spec);
            match prior {
                Some(prior) => B::float_add(dx, prior),
                None => dx,
            }
        }
    };
    LoraGrads { x: dx, a: da, b: db }
}
