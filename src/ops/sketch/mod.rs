//! Ternary gradient sketches: compress a vector by a hash-seeded ternary projection that is never
//! stored, decompress by its transpose ([`format`] defines both and bounds the error). The
//! optimizer [`crate::optim::SketchedAdamW`] keeps AdamW's moments in this compressed space.
//!
//! The kernels recompute the seeded permutation per element (a Feistel network on the index), so
//! a sketch of `n` values costs no memory beyond its `⌈n / r⌉` outputs; the reference path (any
//! backend) builds the index maps on the host instead.

mod autodiff;
mod cube;
pub mod format;
mod fusion;
pub mod reference;

pub use format::{Sketch, SketchError};
pub use kiln_kernels::sketch::AdamWScalars;

use burn::tensor::{DType, FloatDType, Tensor, backend::Backend, ops::FloatTensor};
use kiln_kernels::sketch::SketchParams;

use super::{prim, wrap};
use crate::error::{ensure, ensure_float};
use crate::ops::trit::format::mix32;

/// Backend support for sketches. The default methods are the reference.
pub trait SketchBackend: Backend {
    /// `[n]` values into `[⌈n / r⌉]` f32 bucket sums: signed (`P·g`), or of the squares with
    /// `squares`.
    fn sketch_compress(g: FloatTensor<Self>, sketch: Sketch, squares: bool) -> FloatTensor<Self> {
        reference::compress::<Self>(g, sketch, squares)
    }

    /// `[⌈n / r⌉]` f32 buckets into `[n]` values of `dtype`: signed (`Pᵀ·c`) or the plain gather.
    fn sketch_decompress(c: FloatTensor<Self>, sketch: Sketch, signed: bool, dtype: FloatDType) -> FloatTensor<Self> {
        reference::decompress::<Self>(c, sketch, signed, dtype)
    }

    /// One AdamW step with sketched moments ([`adamw_step`]): the parameter `[n]` and its gradient
    /// (same dtype), the moments `[⌈n / r⌉]` f32, into the new parameter and moments.
    fn sketch_adamw_step(param: FloatTensor<Self>, grad: FloatTensor<Self>, moments: [FloatTensor<Self>; 2], sketch: Sketch, scalars: AdamWScalars) -> [FloatTensor<Self>; 3] {
        reference::adamw_step::<Self>(param, grad, moments, sketch, scalars)
    }
}

crate::backend::reference_backends!(SketchBackend);

impl Sketch {
    /// What the kernels take: sizes, Feistel half width, round keys and seed.
    pub fn params(&self) -> SketchParams {
        let keys = std::array::from_fn(|round| mix32(self.seed as u32 ^ mix32((self.seed >> 32) as u32 ^ round as u32)));
        SketchParams { n: self.n, ratio: self.ratio, half_bits: self.half_bits(), keys, seed: self.seed }
    }
}

#[track_caller]
fn check_len(op: &str, name: &str, got: usize, want: usize, sketch: &Sketch) {
    ensure(got == want, op, || format!("{name} holds {got} values; the sketch of {} values at ratio {} needs {want}", sketch.n, sketch.ratio));
}

/// `P·g` of a flat vector: `[⌈n / r⌉]` f32.
///
/// # Panics
/// If `g` is not a float vector of the sketch's `n` values.
pub fn compress<B: SketchBackend>(g: Tensor<B, 1>, sketch: &Sketch) -> Tensor<B, 1> {
    compress_with(g, sketch, false)
}

/// The bucket sums of `g²` (the unsigned projection of the squares): `[⌈n / r⌉]` f32.
pub fn compress_squares<B: SketchBackend>(g: Tensor<B, 1>, sketch: &Sketch) -> Tensor<B, 1> {
    compress_with(g, sketch, true)
}

fn compress_with<B: SketchBackend>(g: Tensor<B, 1>, sketch: &Sketch, squares: bool) -> Tensor<B, 1> {
    check_len("sketch::compress", "g", g.dims()[0], sketch.n, sketch);
    ensure_float("sketch::compress", "g", g.dtype());
    wrap(B::sketch_compress(prim(g), *sketch, squares))
}

/// `Pᵀ·c`: `[n]` in `dtype`.
///
/// # Panics
/// If `c` does not hold `⌈n / r⌉` values.
pub fn decompress<B: SketchBackend>(c: Tensor<B, 1>, sketch: &Sketch, dtype: DType) -> Tensor<B, 1> {
    decompress_with(c, sketch, true, dtype)
}

/// Each element's bucket value, unsigned (for second moments): `[n]` in `dtype`.
pub fn decompress_unsigned<B: SketchBackend>(c: Tensor<B, 1>, sketch: &Sketch, dtype: DType) -> Tensor<B, 1> {
    decompress_with(c, sketch, false, dtype)
}

fn decompress_with<B: SketchBackend>(c: Tensor<B, 1>, sketch: &Sketch, signed: bool, dtype: DType) -> Tensor<B, 1> {
    check_len("sketch::decompress", "c", c.dims()[0], sketch.compressed(), sketch);
    ensure_float("sketch::decompress", "dtype", dtype);
    let c = prim(c.cast(DType::F32));
    wrap(B::sketch_decompress(c, *sketch, signed, FloatDType::from(dtype)))
}

/// One AdamW step with its moments in the sketch, on a flat parameter (what
/// [`crate::optim::SketchedAdamW`] runs per parameter):
/// `m ← β₁m + (1 − β₁)·P·g`, `v ← β₂v + (1 − β₂)·|P|·g²`, then per element
/// `w ← w·decay − lr · m̂ / (√v̂ + ε)` with `m̂ = (Pᵀm) / bias_1` and `v̂ = (|P|ᵀv) / v_scale`
/// ([`AdamWScalars`]), computed in f32 and rounded once to the parameter's dtype. Returns the new
/// parameter and moments. On CubeCL backends: two kernels, one gather of the gradient for both
/// moments and one permutation per element for the update.
///
/// # Panics
/// If the parameter or gradient do not hold the sketch's `n` values, the moments not `⌈n / r⌉`
/// each, or a tensor is not float.
pub fn adamw_step<B: SketchBackend>(param: Tensor<B, 1>, grad: Tensor<B, 1>, moments: [Tensor<B, 1>; 2], sketch: &Sketch, scalars: AdamWScalars) -> (Tensor<B, 1>, [Tensor<B, 1>; 2]) {
    const OP: &str = "sketch::adamw_step";
    check_len(OP, "param", param.dims()[0], sketch.n, sketch);
    check_len(OP, "grad", grad.dims()[0], sketch.n, sketch);
    ensure_float(OP, "param", param.dtype());
    ensure_float(OP, "grad", grad.dtype());
    let [m, v] = moments;
    check_len(OP, "moment_1", m.dims()[0], sketch.compressed(), sketch);
    check_len(OP, "moment_2", v.dims()[0], sketch.compressed(), sketch);
    let grad = grad.cast(param.dtype());
    let [w, m, v] = B::sketch_adamw_step(prim(param), prim(grad), [prim(m.cast(DType::F32)), prim(v.cast(DType::F32))], *sketch, scalars);
    (wrap(w), [wrap(m), wrap(v)])
}
