//! BitNet b1.58: ternary weights (`{−1, 0, +1}` times a scale) with 8-bit activations (W2A8),
//! for inference on packed weights and for quantization-aware training on latent float weights.
//!
//! - [`format`]: the definition on the host ([`TernaryMatrix`], [`QuantizedActs`]): the
//!   quantizers, kiln's 2-bit packing and HF `BitNetForCausalLM`'s, the exact oracle.
//! - [`TernaryWeight`]: a packed weight `[n, k]` on the device (words, group scales).
//! - [`ternary_matmul`]: `x · Wᵀ` with `x` quantized per row to int8 and integer sums. Up to
//!   [`GEMV_MAX_ROWS`] rows a GEMV reads the packed words directly (on CUDA `dp4a`, one kernel
//!   with the activations' quantization for one row, and integer `mma.sync` for 2–8); more rows run
//!   on Hopper's integer warpgroup MMA from the packed words, on other CUDA devices on cuBLASLt's
//!   int8 tensor cores (both exact i32 sums), elsewhere the codes go through
//!   kiln's GEMM (exact for f32 inputs; half-precision inputs round the sum to their dtype once
//!   before the scale, as HF's `BitLinear` does). Its backward gives the input
//!   gradient of a frozen weight, `dy · W̃` (the activation quantizer passes gradients straight
//!   through): on Hopper a warpgroup-MMA kernel that expands the packed words in shared memory,
//!   elsewhere kiln's GEMM on the dequantized weight.
//! - [`bitlinear`]: the training op on a latent weight: quantize it, quantize `x`, multiply;
//!   gradients go straight through both quantizers to `x` and to the latent weight.
//! - [`bitlinear_normed`], [`ternary_matmul_normed`]: the same with BitLinear's input RMSNorm
//!   folded into the activations' quantization: the kernel that quantizes a row normalizes it in
//!   registers first, and the backward recomputes the normalized rows from `x` and the saved
//!   `rstd`, so the normalized input is neither written nor kept for the backward.

mod backward;
mod cube;
pub mod format;
mod fusion;
pub mod reference;

pub use format::{QuantizedActs, TernaryError, TernaryLayout, TernaryMatrix};
pub use kiln_kernels::ternary::{GEMV_MAX_ROWS, MAX_K};

use burn::tensor::{
    DType, Int, Shape, Tensor, TensorData,
    backend::Backend,
    ops::{FloatTensor, IntTensor},
};

use super::rms_norm::RmsNormBackend;
use super::{prim, wrap};
use crate::error::{ensure, ensure_float};

/// A packed ternary weight, generic over how its tensors are held: Burn tensors
/// ([`TernaryWeight`]) or backend primitives ([`TernaryPrimitive`]).
#[derive(Debug, Clone)]
pub struct TernaryParts<I, F> {
    /// Packed codes, sixteen a u32 word, rows padded to 64 codes (stored as the backend's ints).
    pub words: I,
    /// f32 scales, one per group of output rows (`w ≈ q / s`).
    pub scales: F,
    pub layout: TernaryLayout,
}

/// A packed ternary weight on the device.
pub type TernaryWeight<B> = TernaryParts<Tensor<B, 1, Int>, Tensor<B, 1>>;
/// A packed ternary weight as backend primitives.
pub type TernaryPrimitive<B> = TernaryParts<IntTensor<B>, FloatTensor<B>>;

impl<I, F> TernaryParts<I, F> {
    /// The same weight with each tensor converted.
    pub fn map<I2, F2>(self, int: impl FnOnce(I) -> I2, float: impl FnOnce(F) -> F2) -> TernaryParts<I2, F2> {
        TernaryParts { words: int(self.words), scales: float(self.scales), layout: self.layout }
    }
}

/// An RMSNorm folded into the quantization of activation rows: `γ` `[k]` (the activations'
/// dtype) and each row's `rstd` `[m]` (f32), from which the normalized rows are recomputed.
#[derive(Debug, Clone)]
pub struct RowNorm<F> {
    pub gamma: F,
    pub rstd: F,
}

impl<F> RowNorm<F> {
    /// The same norm with each tensor converted.
    pub fn map<G>(self, f: impl Fn(F) -> G) -> RowNorm<G> {
        RowNorm { gamma: f(self.gamma), rstd: f(self.rstd) }
    }
}

/// Backend support for ternary weights. The default methods are the reference.
pub trait TernaryBackend: RmsNormBackend {
    /// Quantize a `[n, k]` weight with absmean scales per `group` output rows.
    fn ternary_quantize(weight: FloatTensor<Self>, group: usize) -> TernaryPrimitive<Self> {
        reference::quantize::<Self>(weight, group)
    }

    /// The `[n, k]` float weight `q / s` in `dtype`.
    fn ternary_dequantize(weight: TernaryPrimitive<Self>, dtype: DType) -> FloatTensor<Self> {
        reference::dequantize::<Self>(weight, dtype)
    }

    /// Activation rows `[m, k]` quantized: the int8 codes as floats in the dtype of `x`, and the
    /// f32 scales `[m]`.
    fn ternary_quantize_acts(x: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::quantize_acts::<Self>(x)
    }

    /// `x [m, k] · Wᵀ → [m, n]` in the dtype of `x`, `x` quantized per row to int8.
    fn ternary_matmul(x: FloatTensor<Self>, weight: TernaryPrimitive<Self>) -> FloatTensor<Self> {
        reference::matmul::<Self>(x, weight)
    }

    /// `rms_norm(x, γ, ε) [m, k] · Wᵀ` with the normalized rows quantized as
    /// [`TernaryBackend::ternary_matmul`] quantizes `x` (BitLinear's input norm): the product in
    /// the dtype of `x`, and each row's `rstd` `[m]` (f32) for the backward. The reference
    /// normalizes, then multiplies.
    fn ternary_matmul_normed(x: FloatTensor<Self>, gamma: FloatTensor<Self>, epsilon: f64, weight: TernaryPrimitive<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let normed = Self::rms_norm_forward(x, gamma, None, epsilon);
        (Self::ternary_matmul(normed.output, weight), normed.rstd)
    }

    /// `dy [m, n] · (q / s) → [m, k]`: the input gradient of [`TernaryBackend::ternary_matmul`].
    fn ternary_input_grad(dy: FloatTensor<Self>, weight: TernaryPrimitive<Self>) -> FloatTensor<Self> {
        reference::input_grad::<Self>(dy, weight)
    }

    /// `dyᵀ [n, m] · x̃ → [n, k]` with `x̃ = q_x / s_x` the quantized activations (of the rows
    /// normalized by `norm`, if given): the latent weight's gradient of
    /// [`TernaryBackend::bitlinear`] and [`TernaryBackend::bitlinear_normed`], in the dtype of `dy`.
    fn ternary_weight_grad(dy: FloatTensor<Self>, x: FloatTensor<Self>, norm: Option<RowNorm<FloatTensor<Self>>>) -> FloatTensor<Self> {
        reference::weight_grad::<Self>(dy, x, norm)
    }

    /// Quantization-aware `x [m, k] · W̃ᵀ` for a latent float weight `[n, k]`. Without autodiff
    /// this is quantize then [`TernaryBackend::ternary_matmul`]; `Autodiff` adds the
    /// straight-through backward.
    fn bitlinear(x: FloatTensor<Self>, weight: FloatTensor<Self>, group: usize) -> FloatTensor<Self> {
        let weight = Self::ternary_quantize(weight, group);
        Self::ternary_matmul(x, weight)
    }

    /// [`TernaryBackend::bitlinear`] on `rms_norm(x, γ, ε)`: quantize the weight, then
    /// [`TernaryBackend::ternary_matmul_normed`]. `Autodiff` adds a backward that passes the
    /// straight-through gradient on through the norm (to `x` and `γ`) from the saved `rstd`.
    fn bitlinear_normed(x: FloatTensor<Self>, gamma: FloatTensor<Self>, epsilon: f64, weight: FloatTensor<Self>, group: usize) -> FloatTensor<Self> {
        let weight = Self::ternary_quantize(weight, group);
        Self::ternary_matmul_normed(x, gamma, epsilon, weight).0
    }
}

crate::backend::reference_backends!(TernaryBackend);

impl<B: Backend> TernaryWeight<B> {
    /// Quantize a float weight `[n, k]` (`n` output features) with one absmean scale per
    /// `group` output rows (`group = n`: BitNet's per-tensor scale).
    ///
    /// # Panics
    /// If the weight is not float or `group` is not in `1..=n`.
    pub fn quantize(weight: Tensor<B, 2>, group: usize) -> Self
    where
        B: TernaryBackend,
    {
        let [n, k] = weight.dims();
        ensure_float("ternary::quantize", "weight", weight.dtype());
        if let Err(e) = TernaryLayout::new(n, k, group) {
            panic!("{e}");
        }
        B::ternary_quantize(prim(weight), group).map(Tensor::from_primitive, wrap)
    }

    /// Upload a host weight.
    pub fn from_host(matrix: &TernaryMatrix, device: &B::Device) -> Self {
        let words: Vec<i32> = matrix.words.iter().map(|&w| w as i32).collect();
        TernaryParts {
            words: Tensor::from_data(TensorData::new(words, [matrix.words.len()]), device),
            scales: Tensor::from_data(TensorData::new(matrix.scales.clone(), [matrix.scales.len()]), (device, DType::F32)),
            layout: matrix.layout,
        }
    }

    /// Read the weight back to the host.
    pub fn to_host(&self) -> TernaryMatrix {
        let words = self.words.clone().into_data().convert::<i64>().into_vec::<i64>().expect("int words");
        let scales = self.scales.clone().into_data().convert::<f32>().into_vec::<f32>().expect("f32 scales");
        TernaryMatrix::from_words(words.into_iter().map(|w| w as u32).collect(), self.layout, scales).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The float weight `q / s` `[n, k]` in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Tensor<B, 2>
    where
        B: TernaryBackend,
    {
        ensure_float("ternary::dequantize", "dtype", dtype);
        wrap(B::ternary_dequantize(self.primitive(), dtype))
    }

    /// The backend primitives.
    pub fn primitive(&self) -> TernaryPrimitive<B> {
        self.clone().map(Tensor::into_primitive, prim)
    }

    /// The device the weight lives on.
    pub fn device(&self) -> B::Device {
        self.words.device()
    }
}

/// Rows of `x [.., k]` as a `[rows, k]` primitive, after checking `x` against a weight `[n, k]`.
fn rows_of<B: Backend, const D: usize>(op: &str, x: Tensor<B, D>, n: usize, k: usize) -> (FloatTensor<B>, [usize; D]) {
    let dims = x.dims();
    ensure(dims[D - 1] == k, op, || format!("x {dims:?} does not end in the weight's {k} input features (weight [{n}, {k}])"));
    ensure(k <= MAX_K, op, || format!("{k} input features exceed the {MAX_K} whose integer sums stay exact"));
    ensure_float(op, "x", x.dtype());
    let rows = dims[..D - 1].iter().product::<usize>();
    (B::float_reshape(prim(x), Shape::new([rows, k])), dims)
}

/// `[rows, n]` back to `x`'s leading dimensions.
fn unrows<B: Backend, const D: usize>(y: FloatTensor<B>, mut dims: [usize; D], n: usize) -> Tensor<B, D> {
    dims[D - 1] = n;
    wrap(B::float_reshape(y, Shape::from(dims.to_vec())))
}

/// W2A8 `x · Wᵀ` for `x [.., k]` and a packed weight `[n, k]`: `[.., n]` in the dtype of `x`,
/// each row of `x` quantized to int8 with its absmax scale. The weight is frozen: gradients reach
/// `x` only (`dy · W̃`, straight through the activation quantizer).
///
/// # Panics
/// If the last dimension of `x` is not `k`, `k` exceeds [`MAX_K`], or `x` is not float.
pub fn ternary_matmul<B: TernaryBackend, const D: usize>(x: Tensor<B, D>, weight: &TernaryWeight<B>) -> Tensor<B, D> {
    let l = weight.layout;
    let (x, dims) = rows_of("ternary_matmul", x, l.n, l.k);
    unrows(B::ternary_matmul(x, weight.primitive()), dims, l.n)
}

/// Quantization-aware BitNet product for training: `x [.., k]` and a latent float weight
/// `[n, k]` are quantized (absmean ternary with one scale per `group` output rows; int8 per row)
/// and multiplied as [`ternary_matmul`] does. Gradients pass straight through both quantizers:
/// `dx = dy · W̃`, `dW = dyᵀ · x̃` (BitNet's straight-through estimator).
///
/// # Panics
/// On mismatched shapes, a `group` outside `1..=n`, or non-float inputs.
pub fn bitlinear<B: TernaryBackend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 2>, group: usize) -> Tensor<B, D> {
    let [n, k] = check_latent("bitlinear", &x, &weight, group);
    let (x, dims) = rows_of("bitlinear", x, n, k);
    unrows(B::bitlinear(x, prim(weight), group), dims, n)
}

/// [`bitlinear`] on `rms_norm(x, γ, ε)` (BitNet's BitLinear with its input norm), in one kernel
/// before the product: each row is normalized in registers and quantized. Gradients reach `x`,
/// `γ` and the latent weight; the backward recomputes the normalized rows from `x` and each
/// row's saved `rstd` instead of keeping them.
///
/// # Panics
/// As [`bitlinear`], or if `gamma` is not `[k]` in the dtype of `x`.
pub fn bitlinear_normed<B: TernaryBackend, const D: usize>(x: Tensor<B, D>, gamma: Tensor<B, 1>, epsilon: f64, weight: Tensor<B, 2>, group: usize) -> Tensor<B, D> {
    let op = "bitlinear_normed";
    let [n, k] = check_latent(op, &x, &weight, group);
    check_norm(op, &x, &gamma);
    let (x, dims) = rows_of(op, x, n, k);
    unrows(B::bitlinear_normed(x, prim(gamma), epsilon, prim(weight), group), dims, n)
}

/// [`ternary_matmul`] on `rms_norm(x, γ, ε)`, the norm applied in the kernel that quantizes the
/// rows (where the product takes it: the GEMM path on CUDA and elsewhere; up to
/// [`GEMV_MAX_ROWS`] rows the norm's own kernel runs first). Gradients reach `x` and `γ`.
///
/// # Panics
/// As [`ternary_matmul`], or if `gamma` is not `[k]` in the dtype of `x`.
pub fn ternary_matmul_normed<B: TernaryBackend, const D: usize>(x: Tensor<B, D>, gamma: Tensor<B, 1>, epsilon: f64, weight: &TernaryWeight<B>) -> Tensor<B, D> {
    let (op, l) = ("ternary_matmul_normed", weight.layout);
    check_norm(op, &x, &gamma);
    let (x, dims) = rows_of(op, x, l.n, l.k);
    unrows(B::ternary_matmul_normed(x, prim(gamma), epsilon, weight.primitive()).0, dims, l.n)
}

/// The latent weight's `[n, k]` after checking it (float, in the dtype of `x`, `group` in `1..=n`).
fn check_latent<B: Backend, const D: usize>(op: &str, x: &Tensor<B, D>, weight: &Tensor<B, 2>, group: usize) -> [usize; 2] {
    let [n, k] = weight.dims();
    ensure_float(op, "weight", weight.dtype());
    ensure(x.dtype() == weight.dtype(), op, || format!("x has dtype {:?}, the weight {:?}", x.dtype(), weight.dtype()));
    if let Err(e) = TernaryLayout::new(n, k, group) {
        panic!("kiln::{op}: {}", e.0);
    }
    [n, k]
}

/// An input norm's `γ` must be `[k]` for `x [.., k]`, in the dtype of `x`: RMSNorm's own check.
fn check_norm<B: Backend, const D: usize>(op: &str, x: &Tensor<B, D>, gamma: &Tensor<B, 1>) {
    super::rms_norm::validate::<B>(op, &prim(x.clone()), &prim(gamma.clone()), None);
}

/// Activations `[m, k]` quantized per row: the int8 codes (as floats in the dtype of `x`) and the
/// f32 scales `[m]` (`x ≈ q / s`).
pub fn quantize_acts<B: TernaryBackend>(x: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 1>) {
    ensure_float("ternary::quantize_acts", "x", x.dtype());
    let (codes, scales) = B::ternary_quantize_acts(prim(x));
    (wrap(codes), wrap(scales))
}
