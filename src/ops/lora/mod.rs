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
//!
//! Over a float base, [`lora_linear`] is the whole layer, `x · W + b + s · dropout(x) · Aᵀ · Bᵀ`,
//! as one operation, so that a backend may run the base's product and the update as one GEMM: on
//! Hopper the forward's `y` and (without a dropout) the input gradient `dy · Wᵀ + dh · A + prior`
//! are one kernel each (`kiln_kernels::lora::linear`), the update one more block of the base's reduction
//! instead of a second pass over the `[rows, out]` output.
//!
//! Over a frozen 4-bit base (QLoRA), [`lora_linear_4bit`] is the same layer with `W` in
//! bitsandbytes' NF4/FP4 format: the backend's 4-bit products with the update added to them, or
//! on Hopper, where the 4-bit product would dequantize anyway (more than 1024 rows), the weight
//! dequantized into a temporary that the one-GEMM kernel reads, forward and for `dx`, and that
//! is freed after each. The node keeps the packed weight, never the float one.

mod backward;
mod cube;
mod fusion;
mod products;
pub mod reference;

pub use kiln_kernels::lora::DropoutMask;

use burn::tensor::{DType, Shape, Tensor, ops::FloatTensor};

use super::dora::DoraBackend;
use super::matmul::MatmulBackend;
use super::nf4::{Nf4Backend, Quantized4, Quantized4Primitive};
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

/// The gradients of [`lora_linear`] with respect to `x` (base and update; `None` when not asked
/// for), `A` and `B`.
#[derive(Debug, Clone)]
pub struct LoraLinearGrads<T> {
    pub x: Option<T>,
    pub a: T,
    pub b: T,
}

/// Backend support for LoRA updates (and, through [`DoraBackend`], DoRA's rescaling of them). The
/// default methods run the products through the backend's [`MatmulBackend::gemm`] and the dropout
/// through [`LoraBackend::lora_dropout`], whose default is the reference (a mask built on the
/// host).
pub trait LoraBackend: MatmulBackend + DoraBackend + Nf4Backend {
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

    /// `(dh, dB) = (s_dh · dy · B, s_db · dyᵀ · h)` for `scales = [s_dh, s_db]`, the backward's
    /// two products that read `dy` (`[.., out]`; `h` is `[rows, r]`, `b` `[out, r]`, `dh`
    /// `[rows, r]`, `dB` `[out, r]`).
    fn lora_dy_products(dy: FloatTensor<Self>, h: FloatTensor<Self>, b: FloatTensor<Self>, scales: [f32; 2]) -> (FloatTensor<Self>, FloatTensor<Self>) {
        products::dy_products::<Self>(Self::gemm, dy, h, b, scales)
    }

    /// `dropout(s · lhs · op(rhs)) + residual` in the shape `out`, a product that expands the
    /// rank-r `lhs` (`[rows, r]`) to the full width: the forward's `base + s · h · Bᵀ` (`rhs` `B`
    /// `[out, r]`, transposed) and the backward's `dropout(dh · A) + prior` (`rhs` `A` `[r, in]`).
    fn lora_expand(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, residual: Option<FloatTensor<Self>>, spec: ExpandSpec, out: Shape) -> FloatTensor<Self> {
        products::expand::<Self>(Self::gemm, Self::lora_dropout, lhs, rhs, residual, spec, out)
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

    /// `(y, hs)` of a LoRA layer over a float base: `y = x · W + bias + hs · Bᵀ` (`W` the base's
    /// `[in, out]` weight, `y` `[.., out]`) and `hs = s · dropout(x) · Aᵀ` (`[rows, r]`, kept for
    /// the backward).
    fn lora_linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        products::linear_forward(&products::Kernels::<Self>::backend(), x, w, bias, a, b, spec)
    }

    /// The gradients of [`LoraBackend::lora_linear_forward`] from its `x` and `hs` and the output
    /// gradient: `dx = dy · Wᵀ + dropout(s · dy · B · A) + prior` (when `want_dx`), `dA` and `dB`.
    #[allow(clippy::too_many_arguments)]
    fn lora_linear_backward(
        x: FloatTensor<Self>,
        hs: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: LoraSpec,
        prior: Option<FloatTensor<Self>>,
        want_dx: bool,
    ) -> LoraLinearGrads<FloatTensor<Self>> {
        products::linear_backward(&products::Kernels::<Self>::backend(), x, hs, w, a, b, dy, spec, prior, want_dx)
    }

    /// `(y, hs)` of a LoRA layer over a frozen 4-bit base: `y = x · Wᵀ + bias + hs · Bᵀ` (`W` the
    /// `[out, in]` 4-bit weight) and `hs = s · dropout(x) · Aᵀ`, kept for the backward. The
    /// default adds the update to the backend's own 4-bit product
    /// ([`Nf4Backend::matmul_4bit`]); a backend that runs the base's product and the update as
    /// one GEMM dequantizes the weight for it instead, where its 4-bit product would dequantize
    /// anyway.
    fn lora_linear_4bit_forward(
        x: FloatTensor<Self>,
        w: Quantized4Primitive<Self>,
        bias: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        products::linear_4bit_forward(&products::Kernels::<Self>::backend(), x, w, bias, a, b, spec)
    }

    /// The gradients of [`LoraBackend::lora_linear_4bit_forward`]: `dx = dy · W + dropout(s · dy
    /// · B · A) + prior` (when `want_dx`), `dA` and `dB`. The default adds the update's share of
    /// `dx` to the backend's [`Nf4Backend::matmul_4bit_input_grad`]; a backend that runs both in
    /// one product dequantizes the weight for it instead.
    #[allow(clippy::too_many_arguments)]
    fn lora_linear_4bit_backward(
        x: FloatTensor<Self>,
        hs: FloatTensor<Self>,
        w: Quantized4Primitive<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: LoraSpec,
        prior: Option<FloatTensor<Self>>,
        want_dx: bool,
    ) -> LoraLinearGrads<FloatTensor<Self>> {
        products::linear_4bit_backward(&products::Kernels::<Self>::backend(), x, hs, w, a, b, dy, spec, prior, want_dx)
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

/// `x · weight + bias + s · dropout(x) · Aᵀ · Bᵀ` over the last axis: a LoRA layer over a float
/// base in one operation ([`lora`] takes the base's output instead). `weight` is the base's
/// `[in, out]` (Burn's layout), `bias` `[out]`, `a` `[r, in]` and `b` `[out, r]` (PEFT's layouts).
///
/// # Panics
/// If the shapes do not fit as above, or the dtypes differ or are not float.
pub fn lora_linear<B: LoraBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    spec: LoraSpec,
) -> Tensor<B, D> {
    let ws = weight.shape();
    let layer = Layer { op: "lora_linear", d_in: ws[0], d_out: ws[1], weight: || format!("weight {:?} ([d_input, d_output])", ws.as_slice()) };
    layer.check(&x, bias.as_ref(), &a, &b, Some(weight.dtype()));
    wrap(B::lora_linear_forward(prim(x), prim(weight), bias.map(prim), prim(a), prim(b), spec).0)
}

/// `x · Wᵀ + bias + s · dropout(x) · Aᵀ · Bᵀ` over the last axis for a frozen 4-bit weight `W`
/// (QLoRA's layer as one operation): `weight` is `[out, in]` in bitsandbytes' layout, `bias`
/// `[out]` in `x`'s dtype, `a` `[r, in]` and `b` `[out, r]`. The weight takes no gradient; `x`,
/// `A`, `B` and the bias do where they are tracked.
///
/// # Panics
/// If the shapes do not fit as above, or the dtypes differ or are not float.
pub fn lora_linear_4bit<B: LoraBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: &Quantized4<B>,
    bias: Option<Tensor<B, 1>>,
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    spec: LoraSpec,
) -> Tensor<B, D> {
    let l = weight.layout;
    let layer = Layer { op: "lora_linear_4bit", d_in: l.k, d_out: l.n, weight: || format!("the 4-bit weight [{}, {}] ([d_output, d_input])", l.n, l.k) };
    layer.check(&x, bias.as_ref(), &a, &b, None);
    wrap(B::lora_linear_4bit_forward(prim(x), weight.primitive(), bias.map(prim), prim(a), prim(b), spec).0)
}

/// A LoRA layer's base as its public ops check it: the op's name, the widths, and how an error
/// names the weight.
struct Layer<W: Fn() -> String> {
    op: &'static str,
    d_in: usize,
    d_out: usize,
    weight: W,
}

impl<W: Fn() -> String> Layer<W> {
    /// `x` `[.., d_in]`, `bias` `[d_out]`, `a` `[r, d_in]`, `b` `[d_out, r]`, all of one float
    /// dtype (with the float weight's, where it has one).
    fn check<B: LoraBackend, const D: usize>(&self, x: &Tensor<B, D>, bias: Option<&Tensor<B, 1>>, a: &Tensor<B, 2>, b: &Tensor<B, 2>, weight_dtype: Option<DType>) {
        let (op, xs) = (self.op, x.shape());
        ensure(D >= 1 && xs[D - 1] == self.d_in, op, || format!("x {:?} must end in d_input of {}", xs.as_slice(), (self.weight)()));
        let out = products::with_last(xs.clone(), self.d_out);
        check(op, &xs, &out, &a.shape(), &b.shape());
        ensure_float(op, "x", x.dtype());
        let mut dtypes = vec![("x", x.dtype()), ("a", a.dtype()), ("b", b.dtype())];
        dtypes.extend(weight_dtype.map(|d| ("weight", d)));
        if let Some(bias) = bias {
            ensure(bias.shape().as_slice() == [self.d_out], op, || format!("bias {:?} must be [d_output] = [{}]", bias.shape().as_slice(), self.d_out));
            dtypes.push(("bias", bias.dtype()));
        }
        ensure_same_dtype(op, &dtypes);
    }
}

/// `x` under LoRA's dropout `mask` (the same elements [`lora`] drops with it).
pub fn lora_dropout<B: LoraBackend, const D: usize>(x: Tensor<B, D>, mask: DropoutMask) -> Tensor<B, D> {
    ensure_float("lora_dropout", "x", x.dtype());
    wrap(B::lora_dropout(prim(x), mask))
}

/// `x` `[.., in]` against the layer's output shape `out` (the base's output for [`lora`]), `a`
/// `[r, in]` and `b` `[out, r]`.
fn check(op: &str, x: &Shape, out: &Shape, a: &Shape, b: &Shape) {
    let d = x.num_dims();
    let shapes = || format!("x {:?}, output {:?}, a {:?}, b {:?}", x.as_slice(), out.as_slice(), a.as_slice(), b.as_slice());
    ensure(d >= 1 && out.num_dims() == d, op, || format!("x and the base's output must have the same rank ≥ 1: {}", shapes()));
    let (d_in, d_out, r) = (x[d - 1], out[d - 1], a[0]);
    ensure(x.as_slice()[..d - 1] == out.as_slice()[..d - 1], op, || format!("x and the base's output must share their leading axes: {}", shapes()));
    ensure(a[1] == d_in && b[0] == d_out && b[1] == r, op, || format!("a must be [r, in] and b [out, r]: {}", shapes()));
    ensure(x.num_elements() <= u32::MAX as usize, op, || format!("x has more than 2³² elements (the dropout hash indexes with 32 bits): {}", shapes()));
}
