//! Ternary weights from plain Burn ops (any backend; the tests' oracle besides the host format):
//! the quantizers as tensor expressions in f32, the packing with integer shifts, and every
//! product on the unscaled codes (exact integer sums in f32 below `MAX_K`) scaled afterwards.

use burn::tensor::{DType, ElementConversion, FloatDType, Int, Tensor, TensorData, backend::Backend, ops::FloatTensor};

use super::format::{ACT_EPS, ACT_MAX, CODES_PER_WORD, WEIGHT_EPS, code_shift};
use super::{RowNorm, TernaryLayout, TernaryParts, TernaryPrimitive, TernaryWeight};
use crate::ops::nf4::reference::unpack;
use crate::ops::{compute_dtype, prim, wrap};

/// [`super::TernaryBackend::ternary_quantize`].
pub fn quantize<B: Backend>(weight: FloatTensor<B>, group: usize) -> TernaryPrimitive<B> {
    let w: Tensor<B, 2> = wrap(weight);
    let [n, k] = w.dims();
    let layout = TernaryLayout::new(n, k, group).unwrap_or_else(|e| panic!("{e}"));
    let w = w.cast(FloatDType::F32);
    let scales = weight_scales(w.clone(), layout);
    let codes = (w * row_scales(scales.clone(), layout).reshape([n, 1])).round().clamp(-1.0, 1.0) + 1.0;
    TernaryParts { words: prim_int(pack(codes.int(), layout)), scales: prim(scales), layout }
}

/// The absmean scales `1 / max(mean|W|, ε)` of each group of `group` rows of an f32 weight.
pub fn weight_scales<B: Backend>(w: Tensor<B, 2>, layout: TernaryLayout) -> Tensor<B, 1> {
    let TernaryLayout { n, k, group } = layout;
    let groups = layout.groups();
    let device = w.device();
    let mut rows = w.abs().sum_dim(1).reshape([n]);
    if groups * group > n {
        rows = Tensor::cat(vec![rows, Tensor::zeros([groups * group - n], (&device, DType::F32))], 0);
    }
    let sums = rows.reshape([groups, group]).sum_dim(1).reshape([groups]);
    let counts: Vec<f32> = (0..groups).map(|g| ((n - g * group).min(group) * k) as f32).collect();
    let mean = sums / Tensor::<B, 1>::from_data(TensorData::new(counts, [groups]), (&device, DType::F32));
    mean.clone().ones_like() / mean.clamp_min(WEIGHT_EPS)
}

/// Each output row's scale `[n]`.
fn row_scales<B: Backend>(scales: Tensor<B, 1>, layout: TernaryLayout) -> Tensor<B, 1> {
    let groups = layout.groups();
    let per_row = scales.reshape([groups, 1]).expand([groups, layout.group]).reshape([groups * layout.group]);
    per_row.slice(0..layout.n)
}

/// Codes `w + 1` `[n, k]` packed into words, rows padded with code 1. The words are signed
/// 32-bit values (bit 31 counts −2³¹), whatever the backend's int width, so that records holding
/// them as i32 keep them.
fn pack<B: Backend>(codes: Tensor<B, 2, Int>, layout: TernaryLayout) -> Tensor<B, 1, Int> {
    let (n, k, padded) = (layout.n, layout.k, layout.padded_k());
    let device = codes.device();
    let codes = if padded > k { Tensor::cat(vec![codes, Tensor::ones([n, padded - k], &device)], 1) } else { codes };
    let words = layout.words();
    let codes = codes.reshape([words, CODES_PER_WORD]);
    // Element i = 4a + b of a word sits at bit 8b + 2a; the last element holds bits 30 and 31.
    let last = CODES_PER_WORD - 1;
    let shifts: Vec<i64> = (0..last).map(|i| code_shift(i) as i64).collect();
    let shifts = Tensor::<B, 1, Int>::from_ints(shifts.as_slice(), &device).reshape([1, last]).expand([words, last]);
    let low = codes.clone().slice([0..words, 0..last]).bitwise_left_shift(shifts).sum_dim(1);
    let top = codes.slice([0..words, last..CODES_PER_WORD]);
    let bit30 = top.clone().bitwise_and_scalar(1.elem()).bitwise_left_shift_scalar(30.elem());
    let bit31 = top.bitwise_right_shift_scalar(1.elem()).bitwise_left_shift_scalar(31.elem());
    (low + bit30 - bit31).reshape([words])
}

/// The unscaled codes `q` `[n, k]` in `dtype`.
fn codes<B: Backend>(weight: TernaryWeight<B>, dtype: FloatDType) -> Tensor<B, 2> {
    let l = weight.layout;
    let shifts: Vec<i64> = (0..CODES_PER_WORD).map(|i| code_shift(i) as i64).collect();
    let codes = unpack(weight.words, &shifts, 3).reshape([l.n, l.padded_k()]).slice([0..l.n, 0..l.k]);
    codes.float().cast(dtype) - 1.0
}

/// [`super::TernaryBackend::ternary_dequantize`]: `q / s`.
pub fn dequantize<B: Backend>(weight: TernaryPrimitive<B>, dtype: DType) -> FloatTensor<B> {
    let weight: TernaryWeight<B> = weight.map(Tensor::from_primitive, wrap);
    let l = weight.layout;
    let compute = compute_dtype(dtype);
    let scales = row_scales(weight.scales.clone(), l).cast(compute).reshape([l.n, 1]);
    prim((codes(weight, compute) / scales).cast(dtype))
}

/// [`super::TernaryBackend::ternary_quantize_acts`].
pub fn quantize_acts<B: Backend>(x: FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let x: Tensor<B, 2> = wrap(x);
    let (dtype, [m, _]) = (x.dtype(), x.dims());
    let x = x.cast(FloatDType::F32);
    let abs_max = x.clone().abs().max_dim(1);
    let scales = (abs_max.ones_like() * ACT_MAX) / abs_max.clamp_min(ACT_EPS);
    let codes = (x * scales.clone()).round().clamp(-128.0, 127.0);
    (prim(codes.cast(dtype)), prim(scales.reshape([m])))
}

/// [`super::TernaryBackend::ternary_matmul`]: the integer sums of the codes, then
/// `/ (s_x · s_w)`.
pub fn matmul<B: Backend>(x: FloatTensor<B>, weight: TernaryPrimitive<B>) -> FloatTensor<B> {
    let x: Tensor<B, 2> = wrap(x);
    let (dtype, [m, _]) = (x.dtype(), x.dims());
    let compute = compute_dtype(dtype);
    let weight: TernaryWeight<B> = weight.map(Tensor::from_primitive, wrap);
    let l = weight.layout;
    let (xq, sx) = quantize_acts::<B>(prim(x));
    let (xq, sx): (Tensor<B, 2>, Tensor<B, 1>) = (wrap(xq), wrap(sx));
    let sw = row_scales(weight.scales.clone(), l);
    let acc = xq.cast(compute).matmul(codes(weight, compute).transpose());
    let scale = sx.reshape([m, 1]) * sw.reshape([1, l.n]);
    prim((acc / scale.cast(compute)).cast(dtype))
}

/// [`super::TernaryBackend::ternary_input_grad`]: `dy · (q / s)`.
pub fn input_grad<B: Backend>(dy: FloatTensor<B>, weight: TernaryPrimitive<B>) -> FloatTensor<B> {
    let dy: Tensor<B, 2> = wrap(dy);
    let dtype = dy.dtype();
    let compute = compute_dtype(dtype);
    let w: Tensor<B, 2> = wrap(dequantize::<B>(weight, compute.into()));
    prim(dy.cast(compute).matmul(w).cast(dtype))
}

/// [`super::TernaryBackend::ternary_weight_grad`]: `dyᵀ · (q_x / s_x)`, `x` normalized first by
/// `norm`.
pub fn weight_grad<B: Backend>(dy: FloatTensor<B>, x: FloatTensor<B>, norm: Option<RowNorm<FloatTensor<B>>>) -> FloatTensor<B> {
    let x = match norm {
        Some(norm) => normalize::<B>(x, norm),
        None => x,
    };
    let dy: Tensor<B, 2> = wrap(dy);
    let dtype = dy.dtype();
    let compute = compute_dtype(dtype);
    let (xq, sx) = quantize_acts::<B>(x);
    let (xq, sx): (Tensor<B, 2>, Tensor<B, 1>) = (wrap(xq), wrap(sx));
    let m = sx.dims()[0];
    let x_tilde = xq.cast(compute) / sx.cast(compute).reshape([m, 1]);
    prim(dy.cast(compute).transpose().matmul(x_tilde).cast(dtype))
}

/// Rows `x [m, k]` normalized as the forward normalized them: `x · rstd · γ` in the compute
/// dtype, rounded to the dtype of `x` (what `rms_norm` writes).
pub fn normalize<B: Backend>(x: FloatTensor<B>, norm: RowNorm<FloatTensor<B>>) -> FloatTensor<B> {
    let x: Tensor<B, 2> = wrap(x);
    let (dtype, [m, k]) = (x.dtype(), x.dims());
    let compute = compute_dtype(dtype);
    let norm = norm.map(|t| wrap::<B, 1>(t).cast(compute));
    prim((x.cast(compute) * norm.rstd.reshape([m, 1]) * norm.gamma.reshape([1, k])).cast(dtype))
}

fn prim_int<B: Backend>(t: Tensor<B, 1, Int>) -> burn::tensor::ops::IntTensor<B> {
    t.into_primitive()
}
