//! DoRA (weight-decomposed low-rank adaptation, Liu et al. 2024) on top of a LoRA layer's output.
//!
//! DoRA's weight is `m · (W + ΔW) / ‖W + ΔW‖` per output row, `ΔW = s · B · A`, with the norm
//! a constant for the gradient (DoRA §4.3, as PEFT does). Given `u = x · (W + ΔW)ᵀ + b` (the
//! output of [`crate::ops::lora`]) and `c = m / ‖W + ΔW‖`, the layer's output is
//! `y = c · (u − b) + b`: [`dora`], one elementwise pass forward and one backward that also
//! reduces the magnitude's gradient `dm = Σ_rows dy · (u − b) / ‖W + ΔW‖`.
//!
//! The norm itself ([`dora_norm`]) is taken in factored form, never forming `B · A`:
//! `‖W + ΔW‖²_o = ‖W_o‖² + 2s · Σ_k B_ok (A · W_oᵀ)_k + s² · B_o · (A · Aᵀ) · B_oᵀ`, where
//! `‖W_o‖²` is a constant of the frozen base and `A · Wᵀ` is the base layer applied to `A`'s `r`
//! rows, so the step costs one `[r, in] × [in, out]` product instead of PEFT's `[out, in]`
//! weight, its sum and its norm. On CubeCL backends the rest is two launches (the Gram matrix
//! `A · Aᵀ`, then the per-row quadratic form) in place of about fifteen small tensor ops.

mod backward;
mod cube;
mod fusion;
pub mod reference;

use burn::tensor::{Shape, Tensor, backend::Backend, ops::FloatTensor};

use super::{prim, wrap};
use crate::error::{ensure, ensure_float, ensure_same_dtype};

/// Backend support for DoRA's rescaling. The default methods are the reference implementation.
pub trait DoraBackend: Backend {
    /// `y = c · (u − b) + b` with `c = magnitude / norm` per column of `u` `[.., out]`; `magnitude`
    /// and `bias` `[out]` in `u`'s dtype, `norm` `[out]` in any float dtype.
    fn dora_forward(
        u: FloatTensor<Self>,
        magnitude: FloatTensor<Self>,
        norm: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        reference::forward::<Self>(u, magnitude, norm, bias)
    }

    /// `(du, dm)`: `du = c · dy` in `u`'s shape, `dm = Σ_rows dy · (u − b) / norm` in the
    /// magnitude's dtype.
    fn dora_backward(
        u: FloatTensor<Self>,
        magnitude: FloatTensor<Self>,
        norm: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Self>(u, magnitude, norm, bias, dy)
    }

    /// `‖W + s · B · A‖` per output row, f32 (f64 for f64 `a`), from the inputs of [`dora_norm`]
    /// (shapes checked, any float dtypes, no gradient).
    fn dora_norm(weight_norms_sq: FloatTensor<Self>, a_w: FloatTensor<Self>, a: FloatTensor<Self>, b: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        reference::norm::<Self>(weight_norms_sq, a_w, a, b, scale)
    }
}

crate::backend::reference_backends!(DoraBackend);

/// DoRA's output from the LoRA output `u` `[.., out]` (base bias included), the magnitude `m`
/// `[out]`, the weight norm `‖W + ΔW‖` `[out]` (from [`dora_norm`]) and the base layer's bias
/// `[out]`: `y = (m / norm) · (u − b) + b`.
///
/// Gradients flow to `u` and `m`. The norm is a constant (DoRA §4.3), and so is the bias: it is
/// the frozen base layer's.
///
/// # Panics
/// If the shapes do not fit as above, `u`, `m` and `bias` differ in dtype, any is not float, or
/// (under autodiff) the bias requires a gradient.
pub fn dora<B: DoraBackend, const D: usize>(u: Tensor<B, D>, magnitude: Tensor<B, 1>, norm: Tensor<B, 1>, bias: Option<Tensor<B, 1>>) -> Tensor<B, D> {
    check(&u.shape(), &magnitude.shape(), &norm.shape(), bias.as_ref().map(|b| b.shape()).as_ref());
    ensure_float("dora", "u", u.dtype());
    ensure_float("dora", "norm", norm.dtype());
    let mut dtypes = vec![("u", u.dtype()), ("magnitude", magnitude.dtype())];
    if let Some(b) = &bias {
        dtypes.push(("bias", b.dtype()));
    }
    ensure_same_dtype("dora", &dtypes);
    wrap(B::dora_forward(prim(u), prim(magnitude), prim(norm), bias.map(prim)))
}

/// `‖W + s · B · A‖` per output row, in factored form (see the module's documentation), detached
/// from the graph and in f32 (f64 for f64 inputs):
///
/// - `weight_norms_sq` `[out]`: `‖W_o‖²` of the frozen base weight;
/// - `a_w` `[r, out]`: `A · Wᵀ`, the base layer (without its bias) applied to the rows of `A`;
/// - `a` `[r, in]`, `b` `[out, r]`: the adapter; `scale`: its `s`.
///
/// # Panics
/// If the shapes do not fit as above or an input is not float.
pub fn dora_norm<B: DoraBackend>(weight_norms_sq: Tensor<B, 1>, a_w: Tensor<B, 2>, a: Tensor<B, 2>, b: Tensor<B, 2>, scale: f64) -> Tensor<B, 1> {
    let ([r, d_in], [d_out, rb], [ra, d_out_w], [d_out_n]) = (a.dims(), b.dims(), a_w.dims(), weight_norms_sq.dims());
    ensure(rb == r && ra == r && d_out_w == d_out && d_out_n == d_out, "dora_norm", || {
        format!("expected weight_norms_sq [out], a_w [r, out], a [r, in], b [out, r]; got [{d_out_n}], [{ra}, {d_out_w}], [{r}, {d_in}], [{d_out}, {rb}]")
    });
    for (name, t) in [("weight_norms_sq", weight_norms_sq.dtype()), ("a_w", a_w.dtype()), ("a", a.dtype()), ("b", b.dtype())] {
        ensure_float("dora_norm", name, t);
    }
    let [a_w, a, b] = [a_w, a, b].map(|t| prim(t.detach()));
    wrap(B::dora_norm(prim(weight_norms_sq.detach()), a_w, a, b, scale))
}

fn check(u: &Shape, magnitude: &Shape, norm: &Shape, bias: Option<&Shape>) {
    let d = u.num_dims();
    let out = if d == 0 { 0 } else { u[d - 1] };
    let shapes = || {
        let bias = bias.map_or("none".to_string(), |b| format!("{:?}", b.as_slice()));
        format!("u {:?}, magnitude {:?}, norm {:?}, bias {bias}", u.as_slice(), magnitude.as_slice(), norm.as_slice())
    };
    let column = |s: &Shape| s.num_dims() == 1 && s[0] == out;
    ensure(d >= 1 && column(magnitude) && column(norm) && bias.is_none_or(column), "dora", || {
        format!("magnitude, norm and bias must be [out], the last axis of u: {}", shapes())
    });
}
