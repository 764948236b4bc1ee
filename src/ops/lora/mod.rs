//! LoRA's low-rank update on top of a base layer's output:
//! `y = base + s · dropout(x) · Aᵀ · Bᵀ`, with PEFT's `A` (`lora_A.weight`, `[r, in]`) and `B`
//! (`lora_B.weight`, `[out, r]`).
//!
//! Every product is one GEMM through kiln's `ops::matmul` (cuBLASLt on CUDA): the forward writes
//! the `[tokens, r]` intermediate `h = dropout(x) · Aᵀ` once and adds `s · h · Bᵀ` to the base
//! output in the second product's epilogue (alpha = `s`, the base as C). The backward keeps `h`
//! from the forward, takes the rank-r products first (`dh = s · dy · B`, `dB = s · dyᵀ · h`, then
//! `dA = dhᵀ · dropout(x)` and `dx = dropout(dh · A)`): never a `[out, in]` product. On CUDA the
//! first two are one kernel that reads `dy` once (`kiln_kernels::lora::dy`), and with a dropout
//! `dx`, its dropout and any gradient of `x` registered before are one pass
//! (`kiln_kernels::lora::expand`); without one the prior is the `dx` product's `C`.
//! The dropout mask is a hash of the element index and a seed (`kiln_kernels::lora`), rebuilt in
//! the backward instead of stored.

mod backward;
mod cube;
mod fusion;
mod products;
pub mod reference;

pub use kiln_kernels::lora::DropoutMask;

use burn::tensor::{Shape, Tensor, ops::FloatTensor};

use super::dora::DoraBackend;
use super::matmul::MatmulBackend;
use super::{prim, wrap};
use crate::error::{ensure, ensure_float, ensure_same_dtype};

/// The scale and dropout of one adapter's update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraSpec {
    /// `s`: `α / r`, or `α / √r` for rsLoRA.
    pub scale: f32,
    /// The dropout on the adapter's input; `None` when off (inference, or `p = 0`).
    pub dropout: Option<DropoutMask>,
}

/// How [`LoraBackend::lora_expand`] applies its right operand, and the product's scale and
/// dropout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpandSpec {
    /// The right operand is `[n, r]` (`B`), used transposed; otherwise `[r, n]` (`A`).
    pub rhs_transposed: bool,
    pub scale: f32,
    /// A dropout on the product, before the residual is added.
    pub dropout: Option<DropoutMask>,
}

/// The gradients of [`lora`] with respect to `x` (the adapter's share: the base layer adds its
/// own), `A` and `B`.
#[derive(Debug, Clone)]
pub struct LoraGrads<T> {
    pub x: T,
    pub a: T,
    pub b: T,
}

/// Backend support for LoRA updates (and, through [`DoraBackend`], DoRA's rescaling of them). The
/// default methods run the products through the backend's [`MatmulBackend::gemm`] and the dropout
/// through [`LoraBackend::lora_dropout`], whose default is the reference (a mask built on the
/// host).
pub trait LoraBackend: MatmulBackend + DoraBackend {
    /// `x` with the elements `mask` drops zeroed and the others scaled by `1 / (1 − p)`.
    fn lora_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        reference::dropout::<Self>(x, mask)
    }

    /// `(y, h)`: `y = base + s · h · Bᵀ` in `base`'s shape and `h = dropout(x) · Aᵀ` (`[rows, r]`,
    /// kept for the backward).
    fn lora_forward(
        x: FloatTensor<Self>,
        base: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        products::forward(&products::Kernels::<Self>::backend(), x, base, a, b, spec)
    }

    /// `(dh, dB) = (s · dy · B, s · dyᵀ · h)`, the backward's two products that read `dy`
    /// (`[.., out]`; `h` is `[rows, r]`, `b` `[out, r]`, `dh` `[rows, r]`, `dB` `[out, r]`).
    fn lora_dy_products(dy: FloatTensor<Self>, h: FloatTensor<Self>, b: FloatTensor<Self>, scale: f32) -> (FloatTensor<Self>, FloatTensor<Self>) {
        products::dy_products::<Self>(products::backend_gemm::<Self>, dy, h, b, scale)
    }

    /// `dropout(s · lhs · op(rhs)) + residual` in the shape `out`, a product that expands the
    /// rank-r `lhs` (`[rows, r]`) to the full width: the forward's `base + s · h · Bᵀ` (`rhs` `B`
    /// `[out, r]`, transposed) and the backward's `dropout(dh · A) + prior` (`rhs` `A` `[r, in]`).
    fn lora_expand(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, residual: Option<FloatTensor<Self>>, spec: ExpandSpec, out: Shape) -> FloatTensor<Self> {
        products::expand::<Self>(products::backend_gemm::<Self>, Self::lora_dropout, lhs, rhs, residual, spec, out)
    }

    /// The gradients of `x` (plus `prior`, a gradient of `x` registered before), `A` and `B` from
    /// the forward's `x` and `h` and the output gradient.
    #[allow(clippy::too_many_arguments)]
    fn lora_backward(
        x: FloatTensor<Self>,
        h: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: LoraSpec,
        prior: Option<FloatTensor<Self>>,
    ) -> LoraGrads<FloatTensor<Self>> {
        products::backward(&products::Kernels::<Self>::backend(), x, h, a, b, dy, spec, prior)
    }
}

crate::backend::reference_backends!(LoraBackend);

/// `base + s · dropout(x) · Aᵀ · Bᵀ` over the last axis: `x` is `[.., in]`, `base` (the base
/// layer's output) `[.., out]` with the same leading axes, `a` is `[r, in]` and `b` `[out, r]`
/// (PEFT's layouts).
///
/// # Panics
/// If the shapes do not fit as above, or the dtypes differ or are not float.
pub fn lora<B: LoraBackend, const D: usize>(x: Tensor<B, D>, base: Tensor<B, D>, a: Tensor<B, 2>, b: Tensor<B, 2>, spec: LoraSpec) -> Tensor<B, D> {
    check("lora", &x.shape(), &base.shape(), &a.shape(), &b.shape());
    ensure_float("lora", "x", x.dtype());
    ensure_same_dtype("lora", &[("x", x.dtype()), ("base", base.dtype()), ("a", a.dtype()), ("b", b.dtype())]);
    wrap(B::lora_forward(prim(x), prim(base), prim(a), prim(b), spec).0)
}

/// `x` under LoRA's dropout `mask` (the same elements [`lora`] drops with it).
pub fn lora_dropout<B: LoraBackend, const D: usize>(x: Tensor<B, D>, mask: DropoutMask) -> Tensor<B, D> {
    ensure_float("lora_dropout", "x", x.dtype());
    wrap(B::lora_dropout(prim(x), mask))
}

fn check(op: &str, x: &Shape, base: &Shape, a: &Shape, b: &Shape) {
    let d = x.num_dims();
    let shapes = || format!("x {:?}, base {:?}, a {:?}, b {:?}", x.as_slice(), base.as_slice(), a.as_slice(), b.as_slice());
    ensure(d >= 1 && base.num_dims() == d, op, || format!("x and base must have the same rank ≥ 1: {}", shapes()));
    let (d_in, d_out, r) = (x[d - 1], base[d - 1], a[0]);
    ensure(x.as_slice()[..d - 1] == base.as_slice()[..d - 1], op, || format!("x and base must share their leading axes: {}", shapes()));
    ensure(a[1] == d_in && b[0] == d_out && b[1] == r, op, || format!("a must be [r, in] and b [out, r]: {}", shapes()));
    ensure(x.num_elements() <= u32::MAX as usize, op, || format!("x has more than 2³² elements (the dropout hash indexes with 32 bits): {}", shapes()));
}
