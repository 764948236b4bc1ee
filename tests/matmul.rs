//! Dense products (`matmul`, `linear`, `linear_residual`) vs Burn's own ops and the f64 oracle:
//! forward and every gradient, ragged shapes, transposed views, a shared right operand; and the
//! CubeCL half of the cuBLASLt stream handshake (its CUDA half runs in the GPU check).

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor};
use common::checks::{GemmCase, GemmKind, assert_cases};
use common::{random, tensor};
use kiln::KilnAutodiffBackend;

fn mm(transpose_lhs: bool, transpose_rhs: bool, shared_rhs: bool) -> GemmKind {
    GemmKind::Matmul { transpose_lhs, transpose_rhs, shared_rhs }
}

fn cases() -> Vec<GemmCase> {
    let case = |batch, m, k, n, kind, seed| GemmCase { batch, m, k, n, kind, seed };
    vec![
        case(1, 1, 1, 1, mm(false, false, false), 0),
        case(1, 7, 13, 5, mm(false, false, false), 1),
        case(3, 33, 65, 17, mm(false, false, false), 2),
        case(2, 130, 257, 96, mm(false, false, true), 3),
        case(2, 19, 40, 23, mm(true, false, false), 4),
        case(2, 21, 36, 29, mm(false, true, false), 5),
        case(1, 64, 48, 80, mm(true, true, true), 6),
        case(2, 19, 45, 70, GemmKind::Linear { bias: true, residual: false }, 7),
        case(3, 11, 67, 33, GemmKind::Linear { bias: true, residual: true }, 8),
        case(2, 9, 31, 50, GemmKind::Linear { bias: false, residual: true }, 9),
        case(1, 1, 64, 200, GemmKind::Linear { bias: false, residual: false }, 10),
    ]
}

/// On wgpu the product is Burn's matmul (cuBLASLt is CUDA-only), so these cases check kiln's
/// plumbing there — fusion custom op, transposed views, the backward's transpose flags, epilogue
/// adds — on a few shapes; each new shape costs Burn's autotune minutes on lavapipe.
fn wgpu_cases() -> Vec<GemmCase> {
    let all = cases();
    [1, 5, 8].into_iter().map(|i| all[i]).collect()
}

/// Products of at most 16 rows, which take kiln's skinny kernel on every CubeCL backend: rows
/// that are not a power of two, a batch with its own right operands, a transposed left operand
/// (copied dense first) with a shared right one, ragged `k` and `n` (narrow vectors), and a
/// linear layer with bias and residual. Their backward products (more rows) take the tiled path.
fn skinny_cases() -> Vec<GemmCase> {
    let case = |batch, m, k, n, kind, seed| GemmCase { batch, m, k, n, kind, seed };
    vec![
        case(1, 5, 300, 257, GemmKind::Linear { bias: true, residual: true }, 11),
        case(3, 16, 96, 72, mm(false, false, false), 12),
        case(2, 3, 130, 200, mm(true, false, true), 13),
        case(1, 1, 1031, 4100, mm(false, false, false), 14),
    ]
}

#[test]
fn skinny_products_match_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&skinny_cases(), &device, &[DType::F32, DType::F16]);
}

#[test]
fn gemm_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&wgpu_cases(), &device, &[DType::F32]);
}

#[test]
fn gemm_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

/// Operands of rank 4 (batched heads, and a shared `[1, 1, k, n]` right operand folded into one
/// product), rank 2, and a shared left operand (its gradient summed over the batch) enter the op
/// as they are and are viewed as rank 3 inside it: the output and both gradients, in each
/// operand's own shape, equal Burn's matmul on the same backend.
fn any_rank_matches_burn<B: KilnAutodiffBackend>(device: &B::Device) {
    fn check<B: KilnAutodiffBackend, const D: usize>(lhs: &[usize], rhs: &[usize], device: &B::Device) {
        let a = tensor::<B, D>(&random(lhs, 1), DType::F32, device).require_grad();
        let b = tensor::<B, D>(&random(rhs, 2), DType::F32, device).require_grad();
        let (y, y_ref) = (kiln::ops::matmul(a.clone(), b.clone()), a.clone().matmul(b.clone()));
        assert_eq!(y.dims(), y_ref.dims());
        let w = tensor::<B, D>(&random(&y.dims(), 3), DType::F32, device);
        let (g, g_ref) = ((y.clone() * w.clone()).sum().backward(), (y_ref.clone() * w).sum().backward());
        let pairs = [
            ("y", y.into_data(), y_ref.into_data()),
            ("dlhs", a.grad(&g).unwrap().into_data(), a.grad(&g_ref).unwrap().into_data()),
            ("drhs", b.grad(&g).unwrap().into_data(), b.grad(&g_ref).unwrap().into_data()),
        ];
        for (name, got, want) in pairs {
            assert_eq!(got.shape, want.shape, "{name} of {lhs:?}·{rhs:?}");
            got.assert_approx_eq::<f32>(&want, burn::tensor::Tolerance::rel_abs(1e-4, 1e-4));
        }
    }
    check::<B, 4>(&[2, 3, 5, 7], &[2, 3, 7, 4], device);
    check::<B, 4>(&[2, 3, 5, 7], &[1, 1, 7, 4], device);
    check::<B, 2>(&[5, 7], &[7, 4], device);
    check::<B, 3>(&[1, 5, 7], &[3, 7, 4], device);
}

#[test]
fn matmul_of_any_rank_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    any_rank_matches_burn::<Autodiff<burn::backend::Wgpu>>(&device);
}

#[test]
fn matmul_of_any_rank_on_ndarray() {
    any_rank_matches_burn::<Autodiff<NdArray>>(&Default::default());
}

/// Operands that several consumers read, whose gradient shares the backward adds in the products'
/// epilogues: one input projected three ways (q/k/v) beside an elementwise use of it, a square
/// matrix multiplied by itself (lhs and rhs one node), and a batch-shared left operand (its summed
/// gradient) also used elementwise. Every gradient equals Burn's matmul's.
fn shared_operands_match_burn<B: KilnAutodiffBackend>(device: &B::Device) {
    let leaf = |shape: &[usize], seed| tensor::<B, 3>(&random(shape, seed), DType::F32, device).require_grad();
    let (x, square, shared) = (leaf(&[2, 9, 12], 1), leaf(&[1, 6, 6], 2), leaf(&[1, 5, 12], 3));
    let ws: Vec<_> = (0..3).map(|i| leaf(&[1, 12, 7], 10 + i)).collect();
    let loss = |ours: bool| {
        let mm = |a: Tensor<B, 3>, b: Tensor<B, 3>| if ours { kiln::ops::matmul(a, b) } else { a.matmul(b) };
        let mut total = (x.clone() * x.clone()).sum() + (shared.clone() * 0.5).sum();
        for w in &ws {
            let y = mm(x.clone(), w.clone());
            total = total + (y.clone() * y).sum();
        }
        let (sq, sh) = (mm(square.clone(), square.clone()), mm(shared.clone(), x.clone().swap_dims(1, 2)));
        total + (sq.clone() * sq).sum() + (sh.clone() * sh).sum()
    };
    let (g, g_ref) = (loss(true).backward(), loss(false).backward());
    for (name, t) in [("x", &x), ("square", &square), ("shared", &shared), ("w0", &ws[0]), ("w2", &ws[2])] {
        let (got, want) = (t.grad(&g).unwrap().into_data(), t.grad(&g_ref).unwrap().into_data());
        got.assert_approx_eq::<f32>(&want, burn::tensor::Tolerance::rel_abs(1e-4, 1e-4));
        assert!(want.iter::<f32>().any(|v| v.abs() > 1e-3), "{name}'s gradient is not trivially small");
    }
}

#[test]
fn shared_operands_accumulate_every_share_on_ndarray() {
    shared_operands_match_burn::<Autodiff<NdArray>>(&Default::default());
}

#[test]
fn matmul_rejects_mismatched_inner_dims() {
    let device = Default::default();
    let a = Tensor::<NdArray, 2>::ones([2, 8], &device);
    let b = Tensor::<NdArray, 2>::ones([9, 3], &device);
    let msg = common::panic_message(|| kiln::ops::matmul(a, b));
    assert!(msg.contains("kiln::matmul") && msg.contains("[2, 8]") && msg.contains("[9, 3]"), "{msg}");
}

#[test]
fn linear_rejects_bad_bias_and_residual() {
    let device = Default::default();
    let x = Tensor::<NdArray, 3>::ones([2, 3, 8], &device);
    let w = Tensor::<NdArray, 2>::ones([8, 4], &device);
    let msg = common::panic_message(|| kiln::ops::linear(x.clone(), w.clone(), Some(Tensor::ones([5], &device))));
    assert!(msg.contains("kiln::linear") && msg.contains("[5]"), "{msg}");
    let msg = common::panic_message(|| kiln::ops::linear_residual(x, w, None, Tensor::ones([2, 3, 5], &device)));
    assert!(msg.contains("kiln::linear_residual") && msg.contains("[2, 3, 5]"), "{msg}");
}

#[test]
fn linear_module_matches_burn_linear() {
    let device = Default::default();
    let burn_linear = burn::nn::LinearConfig::new(12, 7).init::<NdArray>(&device);
    let x = Tensor::<NdArray, 3>::random([2, 5, 12], burn::tensor::Distribution::Normal(0.0, 1.0), &device);
    let expected = burn_linear.forward(x.clone());
    let kiln_linear: kiln::nn::Linear<NdArray> = burn_linear.into();
    kiln_linear.forward(x).into_data().assert_approx_eq::<f32>(&expected.into_data(), burn::tensor::Tolerance::default());
}

/// The CubeCL half of the stream handshake (`kiln_kernels::stream_handshake`): with its *done*
/// word already holding the nonce, the kernel must write the nonce into its slot's *ready* word,
/// leave every other word alone, and return.
#[test]
fn handshake_kernel_signals_ready_and_returns_once_done() {
    use cubecl::prelude::*;
    use kiln_kernels::stream_handshake::{DONE, READY, SLOT_WORDS, launch_handshake};
    let Some(device) = common::wgpu_device() else { return };
    let client = cubecl::wgpu::WgpuRuntime::client(&device);
    let (slots, slot, nonce) = (8usize, 5usize, 0x1234_5678u32);
    let mut words = vec![7u32; slots * SLOT_WORDS];
    words[slot * SLOT_WORDS + DONE] = nonce;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let handle = client.create_from_slice(&bytes);
    // SAFETY: the buffer holds `slots × SLOT_WORDS` u32 words.
    launch_handshake(&client, unsafe { ArrayArg::from_raw_parts(handle.clone(), slots * SLOT_WORDS) }, slot as u32, nonce);
    let out = client.read_one(handle).expect("read back");
    let got: Vec<u32> = out.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    words[slot * SLOT_WORDS + READY] = nonce;
    assert_eq!(got, words);
}

/// The skinny kernel launched directly on raw buffers: rows padded to a power of two (5 → 8), a
/// ragged column count (one-element vectors), a pitched `rhs` (row stride 40 for 37 columns)
/// shared by a batch of 3 (batch stride 0), an `lhs` row stride above `k`, bias and residual;
/// whole (`splits` = 1) and with `k` split over the grid (f32 partials, then the combine step,
/// uneven shares). The output starts as NaN, so an element never written fails the comparison.
fn skinny_on_raw_buffers(splits: usize) {
    use cubecl::prelude::*;
    use kiln_kernels::matmul::{SkinnyLayout, SkinnyProblem, launch_skinny, launch_skinny_combine};
    let Some(device) = common::wgpu_device() else { return };
    let client = cubecl::wgpu::WgpuRuntime::client(&device);
    let (batch, m, k, n, lhs_row, rhs_row) = (3usize, 5usize, 203usize, 37usize, 210usize, 40usize);
    let values = |len: usize, seed: u64| -> Vec<f32> { common::random(&[len], seed).convert::<f32>().to_vec().unwrap() };
    let (lhs, rhs, bias, residual) =
        (values(batch * m * lhs_row, 1), values(k * rhs_row, 2), values(n, 3), values(batch * m * n, 4));
    let upload = |v: &[f32]| client.create_from_slice(f32::as_bytes(v));
    let (lhs_h, rhs_h, bias_h, res_h) = (upload(&lhs), upload(&rhs), upload(&bias), upload(&residual));
    let out_h = upload(&vec![f32::NAN; batch * m * n]);
    let problem = SkinnyProblem {
        batch,
        m,
        k,
        n,
        lhs_strides: [m * lhs_row, lhs_row],
        rhs_strides: [0, rhs_row],
        elem_size: 4,
        bias: true,
        residual: true,
    };
    assert!(problem.fits(&client));
    let mut plan = problem.plan(&client);
    if splits > 1 {
        plan.splits = splits;
        plan.layout = SkinnyLayout { split: true, bias: false, residual: false, ..plan.layout };
    }
    // SAFETY: each length is the element count of the buffer uploaded for it.
    let arg = |h: &cubecl::server::Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
    let f32_type = f32::as_type_native_unchecked().storage_type();
    let lhs_arg = || arg(&lhs_h, lhs.len());
    let rhs_arg = || arg(&rhs_h, rhs.len());
    let bias_arg = || arg(&bias_h, n);
    let res_arg = || arg(&res_h, residual.len());
    let out_arg = || arg(&out_h, batch * m * n);
    if splits == 1 {
        launch_skinny(&client, [f32_type; 2], &problem, &plan, lhs_arg(), rhs_arg(), bias_arg(), res_arg(), out_arg());
    } else {
        let partials_h = upload(&vec![f32::NAN; splits * batch * m * n]);
        let partials = || arg(&partials_h, splits * batch * m * n);
        launch_skinny(&client, [f32_type; 2], &problem, &plan, lhs_arg(), rhs_arg(), rhs_arg(), rhs_arg(), partials());
        launch_skinny_combine(&client, f32_type, &problem, &plan, partials(), bias_arg(), res_arg(), out_arg());
    }
    let bytes = client.read_one(out_h).expect("read back");
    let got = f32::from_bytes(&bytes);
    for (b, i, j) in (0..batch).flat_map(|b| (0..m).flat_map(move |i| (0..n).map(move |j| (b, i, j)))) {
        let dot: f64 = (0..k).map(|p| lhs[b * m * lhs_row + i * lhs_row + p] as f64 * rhs[p * rhs_row + j] as f64).sum();
        let want = dot + bias[j] as f64 + residual[(b * m + i) * n + j] as f64;
        let at = (b * m + i) * n + j;
        let tol = 1e-5 * (k as f64).sqrt() * (1.0 + want.abs());
        assert!((got[at] as f64 - want).abs() <= tol, "splits {splits}: out[{b}, {i}, {j}] = {} vs {want}", got[at]);
    }
}

#[test]
fn skinny_kernel_matches_host_products() {
    skinny_on_raw_buffers(1);
}

#[test]
fn skinny_kernel_split_over_k_matches_host_products() {
    skinny_on_raw_buffers(3);
}
