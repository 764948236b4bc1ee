//! Flash attention vs the naive reference: output and dq/dk/dv on ragged lengths, GQA ratios
//! 1/2/4/8, causal with and without a cache offset, sliding window, softcap, bias, rows that see
//! no key, very large logits, split-KV decoding, f32/f16 on wgpu; and the tensor-core kernels
//! expanded (not run) for every variant.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor, s};
use common::checks::{AttentionCase, assert_cases};
use kiln::ops::AttentionOptions;

fn cases() -> Vec<AttentionCase> {
    let causal = AttentionOptions::causal();
    let mut cases = vec![
        AttentionCase::new(1, 1, 1, 1, 1, 64),
        AttentionCase { options: causal, ..AttentionCase::new(2, 4, 2, 17, 17, 64) },
        AttentionCase { options: causal, ..AttentionCase::new(1, 4, 1, 63, 63, 80) },
        AttentionCase::new(1, 8, 1, 65, 65, 96),
        AttentionCase { options: causal, ..AttentionCase::new(1, 2, 2, 257, 257, 128) },
        // A window much shorter than the sequence: whole key blocks fall outside it.
        AttentionCase { options: causal.with_window(40), ..AttentionCase::new(1, 2, 1, 320, 320, 64) },
        // Decoding over a cache: one token, then a short chunk (bottom-right causal).
        AttentionCase { options: causal, ..AttentionCase::new(2, 8, 2, 1, 300, 128) },
        AttentionCase { options: causal.with_window(8).with_softcap(30.0), bias: true, ..AttentionCase::new(1, 4, 2, 5, 40, 64) },
        // More queries than keys, causal: the first twelve rows see no key.
        AttentionCase { options: causal, ..AttentionCase::new(1, 2, 1, 17, 5, 64) },
        // Logits in the hundreds.
        AttentionCase { options: AttentionOptions::default().with_scale(20.0), ..AttentionCase::new(1, 2, 2, 33, 47, 64) },
        // A head size outside the common set, with a bias and no mask.
        AttentionCase { bias: true, ..AttentionCase::new(1, 3, 3, 9, 20, 40) },
    ];
    for (i, case) in cases.iter_mut().enumerate() {
        case.seed = 10 * i as u64;
    }
    cases
}

#[test]
fn flash_attention_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases(), &device, &[DType::F32]);
}

/// f16 on a subset: lavapipe compiles every kernel variant anew and runs the reference's matmuls
/// slowly, so the full set runs once (f32) and f16 covers GQA, decoding, all the masks and
/// large logits.
#[test]
fn flash_attention_matches_reference_on_wgpu_f16() {
    let Some(device) = common::wgpu_device() else { return };
    let subset: Vec<_> = cases().into_iter().enumerate().filter(|(i, _)| [1, 6, 7, 8, 9].contains(i)).map(|(_, c)| c).collect();
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&subset, &device, &[DType::F16]);
}

#[test]
fn flash_attention_reference_backward_matches_autodiff_on_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

/// The decode path (one query over the cache, split over the KV length) gives the last row of the
/// full causal forward over the same cache.
#[test]
fn decode_equals_the_last_row_of_the_full_forward() {
    let Some(device) = common::wgpu_device() else { return };
    type B = burn::backend::Wgpu;
    let (batch, q_heads, kv_heads, len, d) = (1, 8, 2, 700, 64);
    let q = common::tensor::<B, 4>(&common::random(&[batch, q_heads, len, d], 1), DType::F32, &device);
    let k = common::tensor::<B, 4>(&common::random(&[batch, kv_heads, len, d], 2), DType::F32, &device);
    let v = common::tensor::<B, 4>(&common::random(&[batch, kv_heads, len, d], 3), DType::F32, &device);
    let full = kiln::ops::flash_attention(q.clone(), k.clone(), v.clone(), None, AttentionOptions::causal());
    let last = q.slice(s![.., .., len - 1..len, ..]);
    let decoded = kiln::ops::flash_attention(last, k, v, None, AttentionOptions::causal());
    let expected = common::values(full.slice(s![.., .., len - 1..len, ..]));
    let got = common::values(decoded);
    let err = expected.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(err < 1e-5, "decode vs full forward: max error {err}");

    let client = <cubecl::wgpu::WgpuRuntime as cubecl::Runtime>::client(&device);
    let shape = kiln_kernels::flash_attention::AttentionShape { batch, q_heads, kv_heads, q_len: 1, kv_len: len, head_dim: d };
    let features = kiln_kernels::flash_attention::AttentionFeatures { causal: true, window: None, softcap: None, bias: false };
    let plan = kiln_kernels::flash_attention::AttentionPlan::new(&client, shape, features, cubecl::ir::StorageType::Scalar(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::F32))).unwrap();
    assert!(plan.splits > 1, "one query token should split the cache over cubes: {plan:?}");
}

#[test]
fn flash_attention_rejects_bad_heads() {
    let device = Default::default();
    let q = Tensor::<NdArray, 4>::ones([1, 3, 4, 8], &device);
    let kv = Tensor::<NdArray, 4>::ones([1, 2, 4, 8], &device);
    let msg = common::panic_message(|| kiln::ops::flash_attention(q, kv.clone(), kv, None, AttentionOptions::default()));
    assert!(msg.contains("kiln::flash_attention") && msg.contains("[1, 3, 4, 8]") && msg.contains("[1, 2, 4, 8]"), "{msg}");
}

#[test]
fn flash_attention_rejects_a_bias_that_does_not_broadcast() {
    let device = Default::default();
    let q = Tensor::<NdArray, 4>::ones([1, 2, 4, 8], &device);
    let bias = Tensor::<NdArray, 4>::ones([1, 2, 4, 5], &device);
    let msg = common::panic_message(|| kiln::ops::flash_attention(q.clone(), q.clone(), q, Some(bias), AttentionOptions::default()));
    assert!(msg.contains("kiln::flash_attention") && msg.contains("[1, 2, 4, 5]") && msg.contains("[1, 2, 4, 4]"), "{msg}");
}

/// The backward's `D = Σ dO·O` row kernel on raw wgpu buffers against a host f64 sum: ragged row
/// counts and widths (one that takes 4-wide vectors, one that takes none), operands stored as
/// `[batch, heads, len, width]` or as `[batch, len, heads, width]` (the Hopper forward's output
/// and a model's gradient), the output poisoned with NaN so a row the kernel skips fails.
#[test]
fn row_dot_kernel_matches_host_sums() {
    use cubecl::prelude::*;
    use kiln_kernels::flash_attention::launch_row_dot;
    let Some(device) = common::wgpu_device() else { return };
    let client = cubecl::wgpu::WgpuRuntime::client(&device);
    let f32_type = f32::as_type_native_unchecked().storage_type();
    // Element strides of (batch, head, row) for a `[b, h, l, w]` operand stored head-major or
    // sequence-major.
    let strides = |[_, h, l, w]: [usize; 4], seq_major: bool| if seq_major { [l * h * w, w, h * w] } else { [h * l * w, l * w, w] };
    let cases = [([1usize, 1, 37, 80], [false, false]), ([1, 1, 5, 33], [false, false]), ([2, 5, 100, 128], [true, false]), ([3, 4, 7, 64], [true, true]), ([2, 3, 9, 36], [false, true])];
    for (shape @ [batch, heads, len, width], layouts) in cases {
        let (rows, size) = (batch * heads * len, batch * heads * len * width);
        let values = |seed: u64| -> Vec<f32> { common::random(&[size], seed).convert::<f32>().to_vec().unwrap() };
        let (a, b) = (values(1), values(2));
        let upload = |v: &[f32]| client.create_from_slice(f32::as_bytes(v));
        let (a_h, b_h, out_h) = (upload(&a), upload(&b), upload(&vec![f32::NAN; rows]));
        // SAFETY: each length is the element count of the buffer uploaded for it.
        let arg = |h: &cubecl::server::Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        let [sa, sb] = layouts.map(|seq_major| strides(shape, seq_major));
        launch_row_dot(&client, f32_type, shape, (arg(&a_h, size), sa), (arg(&b_h, size), sb), arg(&out_h, rows)).unwrap();
        let got = f32::from_bytes(&client.read_one(out_h).expect("read back")).to_vec();
        for (r, value) in got.iter().enumerate() {
            let (n, h, i) = (r / (heads * len), (r / len) % heads, r % len);
            let at = |[sn, sh, si]: [usize; 3], c: usize| n * sn + h * sh + i * si + c;
            let want: f64 = (0..width).map(|c| a[at(sa, c)] as f64 * b[at(sb, c)] as f64).sum();
            let tol = 1e-5 * (width as f64).sqrt() * (1.0 + want.abs());
            assert!((*value as f64 - want).abs() <= tol, "{shape:?} {layouts:?}: delta[{r}] = {value} vs {want}");
        }
    }
}

/// The tensor-core kernels (CUDA `mma.sync`/`cp.async`) cannot run on lavapipe, but CubeCL
/// expands them on any runtime before compiling. Forcing them onto wgpu runs that expansion for
/// every variant — planes per cube, head sizes, masks, bias, softcap, forward and backward — so a
/// comptime mistake (an index past an array, a bad unrolled range) fails here instead of on the
/// GPU machine. The WGSL compiler then refuses the kernel at its first barrier: that refusal is
/// the expected end; any other panic fails the test.
#[test]
fn tensor_core_kernels_expand_for_every_variant() {
    use burn_cubecl::CubeBackend;
    use kiln_kernels::flash_attention::{AttentionFeatures, AttentionPlan, AttentionShape, BackwardArgs, ForwardArgs, launch_backward, launch_forward};
    use std::sync::{Arc, Mutex};
    type R = cubecl::wgpu::WgpuRuntime;
    type C = CubeBackend<R, f32, i32, u32>;
    let Some(device) = common::wgpu_device() else { return };

    // A panic on one of CubeCL's device threads (named `DS…`) does not reach the caller: record
    // those messages; any other panic goes to the previous hook as usual.
    let panics = Arc::new(Mutex::new(Vec::<String>::new()));
    let previous: Arc<dyn Fn(&std::panic::PanicHookInfo) + Send + Sync> = Arc::from(std::panic::take_hook());
    let (seen, fallback) = (panics.clone(), previous.clone());
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name().is_some_and(|n| n.starts_with("DS")) {
            let msg = info.payload().downcast_ref::<String>().cloned().or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()));
            seen.lock().unwrap().push(msg.unwrap_or_default());
        } else {
            fallback(info);
        }
    }));

    let tensor = |shape: [usize; 4]| Tensor::<C, 4>::ones(shape, &device).into_primitive().tensor();
    let stats = |shape: [usize; 3]| Tensor::<C, 3>::zeros(shape, &device).into_primitive().tensor();
    let client = <R as cubecl::Runtime>::client(&device);
    let dtype = cubecl::ir::StorageType::Scalar(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::F32));
    let mut launches = 0;
    for head_dim in [64, 80, 96, 128] {
        for (causal, window, softcap, bias) in [(true, None, None, false), (false, None, None, false), (true, Some(16), Some(30.0), true)] {
            for planes in [1, 4, 12] {
                let (b, hq, hk, sq, sk) = (1, 4, 2, 100, 300);
                let shape = AttentionShape { batch: b, q_heads: hq, kv_heads: hk, q_len: sq, kv_len: sk, head_dim };
                let features = AttentionFeatures { causal, window, softcap, bias };
                let base = AttentionPlan::new(&client, shape, features, dtype).unwrap();
                let plan = AttentionPlan { tensor_cores: true, planes, backward_planes: planes, splits: 1, split_len: sk.div_ceil(64) * 64, ..base };
                let (q, k, v, bias_t) = (tensor([b, hq, sq, head_dim]), tensor([b, hk, sk, head_dim]), tensor([b, hk, sk, head_dim]), tensor([b, hq, sq, sk]));
                let (lse, delta) = (stats([b, hq, sq]), stats([b, hq, sq]));
                let forward = ForwardArgs {
                    q: q.clone().into_tensor_arg(),
                    k: k.clone().into_tensor_arg(),
                    v: v.clone().into_tensor_arg(),
                    bias: bias_t.clone().into_tensor_arg(),
                    out: tensor([b, hq, sq, head_dim]).into_tensor_arg(),
                    lse: lse.clone().into_tensor_arg(),
                };
                launch_forward(&client, &plan, shape, features, 0.1, dtype, dtype, forward);
                let backward = || BackwardArgs {
                    q: q.clone().into_tensor_arg(),
                    k: k.clone().into_tensor_arg(),
                    v: v.clone().into_tensor_arg(),
                    bias: bias_t.clone().into_tensor_arg(),
                    d_out: tensor([b, hq, sq, head_dim]).into_tensor_arg(),
                    lse: lse.clone().into_tensor_arg(),
                    delta: delta.clone().into_tensor_arg(),
                };
                let grads = [tensor([b, hq, sq, head_dim]), tensor([b, hk, sk, head_dim]), tensor([b, hk, sk, head_dim])].map(|t| t.into_tensor_arg());
                let [dq, dk, dv] = grads;
                launch_backward(&client, &plan, shape, features, 0.1, dtype, backward(), backward(), dq, dk, dv);
                launches += 2;
            }
        }
    }
    let _ = Tensor::<C, 1>::ones([1], &device).into_data();
    std::panic::set_hook(Box::new(move |info| previous(info)));

    let panics = panics.lock().unwrap();
    let refused = panics.iter().filter(|m| m.contains("isn't supported on wgpu")).count();
    let other: Vec<_> = panics.iter().filter(|m| !m.contains("isn't supported on wgpu")).collect();
    assert!(other.is_empty(), "tensor-core kernel expansion failed: {other:?}");
    assert!(refused > 0 && refused <= launches, "expected the WGSL compiler to refuse the {launches} expanded kernels, saw {refused} refusals");
}
