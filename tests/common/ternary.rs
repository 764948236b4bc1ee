//! The device side of the ternary (BitNet W2A8) checks, shared by the CI tests (wgpu, NdArray)
//! and the GPU check (CUDA): packing, activation codes and products against the host definition
//! (`kiln::ops::ternary::format`) with integer equality where the path is integer, the
//! straight-through gradients against the formulas in f64. Outputs are poisoned first.

use burn::tensor::{DType, Tensor, TensorData, backend::AutodiffBackend};
use kiln::KilnBackend;
use kiln::ops::ternary::{QuantizedActs, TernaryLayout, TernaryMatrix, TernaryWeight, bitlinear, bitlinear_normed, quantize_acts, ternary_matmul, ternary_matmul_normed};

use super::checks::{prim, wrap};
use super::{poison, random, unit_roundoff, values};

/// A product shape: `m` activation rows, weight `[n, k]`, `group` output rows per scale.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

pub const fn shape(m: usize, n: usize, k: usize, group: usize) -> Shape {
    Shape { m, n, k, group }
}

/// Host values of a random `[rows, cols]` tensor stored in `dtype` (so the host sees exactly what
/// the device holds), with row `zero_row` set to zeros (the scales' ε floor) if given.
fn host_values(rows: usize, cols: usize, seed: u64, dtype: DType, zero_row: Option<usize>) -> (TensorData, Vec<f32>) {
    let mut v: Vec<f64> = random(&[rows, cols], seed).to_vec().unwrap();
    if let Some(r) = zero_row.filter(|&r| r < rows) {
        v[r * cols..(r + 1) * cols].iter_mut().for_each(|x| *x = 0.0);
    }
    let data = TensorData::new(v, [rows, cols]).convert_dtype(dtype);
    let host = data.clone().convert::<f32>().into_vec::<f32>().unwrap();
    (data, host)
}

fn floats(v: Vec<f64>) -> Vec<f32> {
    v.into_iter().map(|x| x as f32).collect()
}

/// `v` rounded to `dtype` and back (the device's output rounding).
fn stored(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(v).to_f32(),
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Quantization, dequantization, activation codes and the W2A8 product against the host.
pub fn check_kernels<B: KilnBackend>(device: &B::Device, dtype: DType, shapes: &[Shape]) {
    for (i, s) in shapes.iter().enumerate() {
        let ctx = format!("{s:?} {dtype:?}");
        let seed = 100 + 10 * i as u64;
        let layout = TernaryLayout::new(s.n, s.k, s.group).unwrap();
        // A zero row in the weight (its group's scale hits ε when the group is one row) and in x.
        let (w_data, w_host) = host_values(s.n, s.k, seed, dtype, Some(s.n / 2));
        let (x_data, x_host) = host_values(s.m, s.k, seed + 1, dtype, Some(s.m / 2));

        poison::<B>(device, 2 * s.n * s.k + 64, DType::F32);
        let weight = TernaryWeight::<B>::quantize(Tensor::from_data(w_data, (device, dtype)), s.group);
        let ours = weight.to_host();
        let expected = TernaryMatrix::quantize(&w_host, layout).unwrap();
        for (g, (a, b)) in ours.scales.iter().zip(&expected.scales).enumerate() {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{ctx}: scale {g}: {a} vs host {b}");
        }
        let with_our_scales = TernaryMatrix::quantize_with_scales(&w_host, layout, ours.scales.clone()).unwrap();
        assert_eq!(ours.words, with_our_scales.words, "{ctx}: packed codes");

        poison::<B>(device, 2 * s.n * s.k + 64, DType::F32);
        let deq = floats(values(weight.dequantize(dtype)));
        let exact: Vec<f32> = ours.dequantize().into_iter().map(|v| stored(v, dtype)).collect();
        assert_eq!(deq, exact, "{ctx}: dequantized weight");

        poison::<B>(device, 2 * s.m * s.k + 64, DType::F32);
        let x: Tensor<B, 2> = Tensor::from_data(x_data, (device, dtype));
        let (codes, scales) = quantize_acts(x.clone());
        let acts = QuantizedActs::quantize(&x_host, s.k).unwrap();
        assert_eq!(floats(values(codes)), acts.codes.iter().map(|&c| c as f32).collect::<Vec<_>>(), "{ctx}: activation codes");
        assert_eq!(floats(values(scales)), acts.scales, "{ctx}: activation scales");

        poison::<B>(device, 2 * s.m * s.n + 64, DType::F32);
        let y = floats(values(ternary_matmul(x, &weight)));
        check_product(&ctx, &y, &ours, &x_host, s.m, dtype);
    }
}

/// A W2A8 product `y` of `m` rows against the host's on the activations `x`: exact, except that
/// above `GEMV_MAX_ROWS` half-precision inputs round the integer sum to their dtype first.
fn check_product(ctx: &str, y: &[f32], weight: &TernaryMatrix, x: &[f32], m: usize, dtype: DType) {
    let acc = weight.accumulate(&QuantizedActs::quantize(x, weight.layout.k).unwrap());
    let exact = weight.matmul(x).unwrap();
    let rounded_sum = m > kiln::ops::ternary::GEMV_MAX_ROWS && dtype != DType::F32;
    for (j, (got, want)) in y.iter().zip(&exact).enumerate() {
        let want = stored(*want, dtype);
        if rounded_sum {
            let tol = 2.0 * unit_roundoff(dtype) as f32 * want.abs() + f32::MIN_POSITIVE;
            assert!((got - want).abs() <= tol, "{ctx}: y[{j}] = {got}, host {want} (sum {})", acc[j]);
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{ctx}: y[{j}] = {got}, host {want} (sum {})", acc[j]);
        }
    }
}

/// Maximum over elements of `|got − want| / Σ|terms|`, where `terms` bounds each element's sum of
/// absolute products.
fn relative_error(got: &[f64], want: &[f64], terms: &[f64]) -> f64 {
    got.iter().zip(want).zip(terms).map(|((g, w), t)| (g - w).abs() / t.max(f64::MIN_POSITIVE)).fold(0.0, f64::max)
}

/// The dense product `a [r, inner] · b [inner, c]` in f64, with each element's sum of absolute
/// products.
fn product(a: &[f64], b: &[f64], r: usize, inner: usize, c: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; r * c];
    let mut abs = vec![0.0; r * c];
    for i in 0..r {
        for t in 0..inner {
            let av = a[i * inner + t];
            for j in 0..c {
                out[i * c + j] += av * b[t * c + j];
                abs[i * c + j] += (av * b[t * c + j]).abs();
            }
        }
    }
    (out, abs)
}

fn transpose(a: &[f64], r: usize, c: usize) -> Vec<f64> {
    (0..c).flat_map(|j| (0..r).map(move |i| a[i * c + j])).collect()
}

/// [`bitlinear`]'s straight-through gradients (`dx = r · W̃`, `dW = rᵀ · x̃` for the loss
/// `Σ y · r`) and [`ternary_matmul`]'s input gradient, against f64 products of the host's
/// quantized values (the device's scales). `input_roundoff` is the unit roundoff the products'
/// inputs are rounded to: the dtype's, or TF32's (2⁻¹¹) where f32 products run on tensor cores.
pub fn check_gradients<B: KilnBackend + AutodiffBackend>(device: &B::Device, dtype: DType, input_roundoff: f64, shapes: &[Shape]) {
    let u = input_roundoff.max(unit_roundoff(dtype));
    for (i, s) in shapes.iter().enumerate() {
        let ctx = format!("{s:?} {dtype:?} gradients");
        let seed = 500 + 10 * i as u64;
        let (w_data, _) = host_values(s.n, s.k, seed, dtype, None);
        let (x_data, x_host) = host_values(s.m, s.k, seed + 1, dtype, None);
        let (r_data, r_host) = host_values(s.m, s.n, seed + 2, dtype, None);
        let w: Tensor<B, 2> = Tensor::from_data(w_data, (device, dtype)).require_grad();
        let x: Tensor<B, 2> = Tensor::from_data(x_data, (device, dtype)).require_grad();
        let r: Tensor<B, 2> = Tensor::from_data(r_data, (device, dtype));
        let quantized = TernaryWeight::<B>::quantize(w.clone().detach(), s.group).to_host();

        poison::<B>(device, 4 * s.n * s.k + 64, DType::F32);
        let y = bitlinear(x.clone(), w.clone(), s.group);
        let grads = (y * r.clone()).sum().backward();
        let dx = values(x.grad(&grads).expect("dx"));
        let dw = values(w.grad(&grads).expect("dW"));

        let r64: Vec<f64> = r_host.iter().map(|&v| v as f64).collect();
        let w_tilde: Vec<f64> = quantized.dequantize().iter().map(|&v| v as f64).collect();
        let x_tilde: Vec<f64> = QuantizedActs::quantize(&x_host, s.k).unwrap().dequantize().iter().map(|&v| v as f64).collect();
        let (want_dx, abs_dx) = product(&r64, &w_tilde, s.m, s.n, s.k);
        let (want_dw, abs_dw) = product(&transpose(&r64, s.m, s.n), &x_tilde, s.n, s.m, s.k);
        // Inputs and outputs rounded to the dtype, f32 accumulation.
        let tol = |depth: usize| 4.0 * u + depth as f64 * 2f64.powi(-24);
        assert!(relative_error(&dx, &want_dx, &abs_dx) <= tol(s.n), "{ctx}: dx error {}", relative_error(&dx, &want_dx, &abs_dx));
        assert!(relative_error(&dw, &want_dw, &abs_dw) <= tol(s.m), "{ctx}: dW error {}", relative_error(&dw, &want_dw, &abs_dw));

        let frozen = TernaryWeight::<B>::from_host(&quantized, device);
        let x2 = x.clone().detach().require_grad();
        let grads = (ternary_matmul(x2.clone(), &frozen) * r).sum().backward();
        let dx2 = values(x2.grad(&grads).expect("dx of the packed product"));
        assert!(relative_error(&dx2, &want_dx, &abs_dx) <= tol(s.n), "{ctx}: packed dx error {}", relative_error(&dx2, &want_dx, &abs_dx));
    }
}

/// RMSNorm's backward in f64 for rows `x [m, k]` normalized with the device's `rstd`, given the
/// normalized rows' gradient `du` and a bound `abs_du` of its terms: `(dx, dγ)` and bounds of
/// their terms, `dx = rstd · (du·γ − n · mean(du·γ·n))`, `dγ = Σ_rows du · n`, `n = x · rstd`.
fn rms_norm_grads(x: &[f32], gamma: &[f32], rstd: &[f32], du: &[f64], abs_du: &[f64], k: usize) -> [Vec<f64>; 4] {
    let [mut dx, mut abs_dx] = [vec![0.0; x.len()], vec![0.0; x.len()]];
    let [mut dg, mut abs_dg] = [vec![0.0; k], vec![0.0; k]];
    for (row, &r) in rstd.iter().enumerate() {
        let r = r as f64;
        let at = |j: usize| row * k + j;
        let n = |j: usize| x[at(j)] as f64 * r;
        let g = |j: usize| gamma[j] as f64;
        let c = (0..k).map(|j| du[at(j)] * g(j) * n(j)).sum::<f64>() / k as f64;
        let abs_c = (0..k).map(|j| abs_du[at(j)] * (g(j) * n(j)).abs()).sum::<f64>() / k as f64;
        for j in 0..k {
            dx[at(j)] = r * (du[at(j)] * g(j) - n(j) * c);
            abs_dx[at(j)] = r * (abs_du[at(j)] * g(j).abs() + n(j).abs() * abs_c);
            dg[j] += du[at(j)] * n(j);
            abs_dg[j] += abs_du[at(j)] * n(j).abs();
        }
    }
    [dx, abs_dx, dg, abs_dg]
}

/// [`bitlinear_normed`] and [`ternary_matmul_normed`], BitLinear's input RMSNorm inside the
/// activations' quantization: each row's `rstd` against f64; the product exactly as the host
/// computes it on the rows normalized with that `rstd` (`x · rstd · γ`, rounded to the dtype);
/// the gradients of the latent weight (`rᵀ · ũ`), of `x` and of `γ` (`r · W̃` through RMSNorm's
/// backward) against f64, for the loss `Σ y · r`.
pub fn check_normed<B: KilnBackend + AutodiffBackend>(device: &B::Device, dtype: DType, input_roundoff: f64, shapes: &[Shape]) {
    let u = input_roundoff.max(unit_roundoff(dtype));
    let epsilon = 1e-6;
    for (i, s) in shapes.iter().enumerate() {
        let ctx = format!("{s:?} {dtype:?} normed");
        let seed = 900 + 10 * i as u64;
        let (w_data, _) = host_values(s.n, s.k, seed, dtype, None);
        let (x_data, x_host) = host_values(s.m, s.k, seed + 1, dtype, None);
        let (g_data, g_host) = host_values(1, s.k, seed + 2, dtype, None);
        let (r_data, r_host) = host_values(s.m, s.n, seed + 3, dtype, None);
        let w: Tensor<B, 2> = Tensor::from_data(w_data, (device, dtype)).require_grad();
        let x: Tensor<B, 2> = Tensor::from_data(x_data, (device, dtype)).require_grad();
        let gamma: Tensor<B, 1> = Tensor::<B, 2>::from_data(g_data, (device, dtype)).reshape([s.k]).require_grad();
        let r: Tensor<B, 2> = Tensor::from_data(r_data, (device, dtype));
        let weight = TernaryWeight::<B>::quantize(w.clone().detach(), s.group);
        let quantized = weight.to_host();

        poison::<B>(device, 2 * s.m * s.n + 64, DType::F32);
        let (y, rstd) = B::ternary_matmul_normed(prim(x.clone().detach()), prim(gamma.clone().detach()), epsilon, weight.primitive());
        let (y, rstd) = (floats(values(wrap::<B, 2>(y))), floats(values(wrap::<B, 1>(rstd))));
        let mut normed = vec![0f32; s.m * s.k];
        for (row, &r) in rstd.iter().enumerate() {
            let xs = &x_host[row * s.k..(row + 1) * s.k];
            let want = 1.0 / (xs.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / s.k as f64 + epsilon).sqrt();
            let tol = (s.k as f64 + 4.0) * 2f64.powi(-24) * want;
            assert!((r as f64 - want).abs() <= tol, "{ctx}: rstd[{row}] = {r}, f64 {want}");
            for (j, &v) in xs.iter().enumerate() {
                normed[row * s.k + j] = stored(v * r * g_host[j], dtype);
            }
        }
        check_product(&ctx, &y, &quantized, &normed, s.m, dtype);

        poison::<B>(device, 4 * s.n * s.k + 64, DType::F32);
        let grads = (bitlinear_normed(x.clone(), gamma.clone(), epsilon, w.clone(), s.group) * r.clone()).sum().backward();
        let dx = values(x.grad(&grads).expect("dx"));
        let dg = values(gamma.grad(&grads).expect("dγ"));
        let dw = values(w.grad(&grads).expect("dW"));

        let r64: Vec<f64> = r_host.iter().map(|&v| v as f64).collect();
        let w_tilde: Vec<f64> = quantized.dequantize().iter().map(|&v| v as f64).collect();
        let u_tilde: Vec<f64> = QuantizedActs::quantize(&normed, s.k).unwrap().dequantize().iter().map(|&v| v as f64).collect();
        let (want_dw, abs_dw) = product(&transpose(&r64, s.m, s.n), &u_tilde, s.n, s.m, s.k);
        let (du, abs_du) = product(&r64, &w_tilde, s.m, s.n, s.k);
        let [want_dx, abs_dx, want_dg, abs_dg] = rms_norm_grads(&x_host, &g_host, &rstd, &du, &abs_du, s.k);
        let tol = |depth: usize| 4.0 * u + depth as f64 * 2f64.powi(-24);
        let check = |name: &str, got: &[f64], want: &[f64], terms: &[f64], depth: usize| {
            let e = relative_error(got, want, terms);
            assert!(e <= tol(depth), "{ctx}: {name} error {e}");
        };
        check("dW", &dw, &want_dw, &abs_dw, s.m);
        check("dx", &dx, &want_dx, &abs_dx, s.n + s.k);
        check("dγ", &dg, &want_dg, &abs_dg, s.n + s.m);

        let (x2, gamma2) = (x.clone().detach().require_grad(), gamma.clone().detach().require_grad());
        let grads = (ternary_matmul_normed(x2.clone(), gamma2.clone(), epsilon, &weight) * r).sum().backward();
        check("packed dx", &values(x2.grad(&grads).expect("packed dx")), &want_dx, &abs_dx, s.n + s.k);
        check("packed dγ", &values(gamma2.grad(&grads).expect("packed dγ")), &want_dg, &abs_dg, s.n + s.m);
    }
}
