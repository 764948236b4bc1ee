//! Flash attention on the GPU: parity of the tensor-core kernels against the reference and an
//! f64 oracle, the backward's probe, and timings at the FlashAttention-2 paper's shapes and of one
//! decoding step.

use super::*;

/// Attention on `BK`'s primitives from host data `[q, k, v, d_out]`: the output, then (with
/// `backward`) dq, dk, dv, through the kernels (`kernel`) or the reference. The kernel's forward
/// output and log-sum-exp feed the kernel's backward, the reference's feed the reference's.
#[allow(clippy::too_many_arguments)]
fn attention_outputs<BK: FlashAttentionBackend>(kernel: bool, backward: bool, inputs: &[burn::tensor::TensorData; 4], bias: Option<&burn::tensor::TensorData>, options: AttentionOptions, dtype: DType, device: &BK::Device) -> Vec<Vec<f64>> {
    use kiln::ops::flash_attention::reference;
    let [q, k, v, d_out] = inputs.clone().map(|d| common::tensor::<BK, 4>(&d, dtype, device).into_primitive().tensor());
    let bias = bias.map(|d| common::tensor::<BK, 4>(d, dtype, device).into_primitive().tensor());
    let forward = if kernel { BK::flash_attention_forward } else { reference::forward::<BK> };
    let fwd = forward(q.clone(), k.clone(), v.clone(), bias.clone(), options);
    let wrap = |t| common::values(Tensor::<BK, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(t)));
    let mut out = vec![wrap(fwd.output.clone())];
    if backward {
        let backward = if kernel { BK::flash_attention_backward } else { reference::backward::<BK> };
        let (dq, dk, dv) = backward(q, k, v, bias, fwd.output, fwd.lse, d_out, options);
        out.extend([dq, dk, dv].map(wrap));
    }
    out
}

/// The tensor-core forward and backward in `dtype` (bf16 or f16) against the f64 oracle, with
/// the reference (Burn ops on CUDA) in the same dtype as the baseline of DEVELOPERS.md's rule.
/// The backward runs on the backend's primitives (the kernel's forward output and log-sum-exp
/// feed the kernel's backward, the reference's feed the reference's), with a random output
/// gradient; the memory pool is poisoned before each case. `backward` = false checks the forward
/// alone (decode-sized cases are cheap that way).
pub(super) fn parity_tensor_cores(device: &CudaDevice, dtype: DType, backward: bool) -> bool {
    let mut ok = true;
    let causal = AttentionOptions::causal();
    let cases = [
        // Decoding and speculative decoding: few packed rows, split KV (32 splits of 640 keys,
        // the last ragged, for the first).
        AttentionCase { options: causal, ..AttentionCase::new(1, 32, 8, 1, 20000, 128) },
        AttentionCase { options: causal, ..AttentionCase::new(1, 8, 2, 5, 3000, 64) },
        AttentionCase { options: causal, ..AttentionCase::new(2, 8, 2, 257, 257, 128) },
        AttentionCase::new(1, 4, 4, 300, 1000, 64),
        AttentionCase { options: causal.with_window(64).with_softcap(30.0), bias: true, ..AttentionCase::new(1, 4, 2, 65, 300, 96) },
        AttentionCase { options: causal, ..AttentionCase::new(1, 2, 1, 100, 37, 80) },
        // Whole unmasked tiles and a ragged tail; an 8-way group; causal with a cache offset.
        AttentionCase::new(1, 8, 1, 1000, 1000, 128),
        AttentionCase { options: causal, ..AttentionCase::new(2, 4, 2, 100, 1000, 128) },
        // Logits in the hundreds, and a negative scale (the base-2 softmax folds only a
        // positive scale into the exponent; a negative one takes the full-logit path).
        AttentionCase { options: causal.with_scale(20.0), ..AttentionCase::new(1, 4, 2, 129, 200, 128) },
        AttentionCase { options: AttentionOptions::default().with_scale(-0.2), ..AttentionCase::new(1, 4, 4, 70, 130, 64) },
        // More queries than keys, causal: the first 135 rows see no key (output 0).
        AttentionCase { options: causal, ..AttentionCase::new(2, 8, 2, 200, 65, 128) },
    ];
    // `KILN_PARITY_CASES=2,7`: only those cases (indices into `cases`).
    let only: Option<Vec<usize>> = std::env::var("KILN_PARITY_CASES").ok().map(|v| v.split(',').filter_map(|i| i.trim().parse().ok()).collect());
    for (index, case) in cases.into_iter().enumerate() {
        if only.as_ref().is_some_and(|only| !only.contains(&index)) {
            continue;
        }
        let start = Instant::now();
        let data = |shape: &[usize], seed| common::random(shape, seed);
        let (qs, ks) = ([case.batch, case.q_heads, case.q_len, case.head_dim], [case.batch, case.kv_heads, case.kv_len, case.head_dim]);
        let inputs = [data(&qs, 1), data(&ks, 2), data(&ks, 3), data(&qs, 5)];
        let bias = case.bias.then(|| data(&[case.batch, case.q_heads, case.q_len, case.kv_len], 4));
        common::poison::<B>(device, case.footprint() * 4, dtype);
        let kernel = attention_outputs::<B>(true, backward, &inputs, bias.as_ref(), case.options, dtype, device);
        let reference = attention_outputs::<B>(false, backward, &inputs, bias.as_ref(), case.options, dtype, device);
        let oracle = attention_outputs::<burn::backend::NdArray<f64>>(false, backward, &inputs, bias.as_ref(), case.options, DType::F64, &Default::default());
        for (i, name) in ["out", "dq", "dk", "dv"].into_iter().enumerate().take(kernel.len()) {
            let c = common::compare(name, &kernel[i], &reference[i], &oracle[i], dtype, case.depth());
            println!("parity tensor-core attention {case:?} {dtype:?} {name} kernel_err {:.3e} ref_err {:.3e} bound {:.3e} {} ({:.1} s)", c.kernel_err, c.reference_err, c.bound, if c.passed() { "ok" } else { "FAIL" }, start.elapsed().as_secs_f64());
            ok &= c.passed();
        }
    }
    ok
}

/// Quick backward probe without Burn's same-dtype reference (whose kernels take most of
/// `parity-tensor-cores`' time to compile): bf16 kernel gradients against the f64 oracle for
/// each head size, two shapes (one with a causal offset and fewer keys than a backward block),
/// under each setting in `KILN_PROBE_SETTINGS` (`VAR=VALUE,VAR=VALUE;...`, default: one run as
/// is). Prints the largest error of each gradient relative to the oracle's largest magnitude,
/// and dQ's first columns of the first row that sees a key.
pub(super) fn attention_probe(device: &CudaDevice) {
    let settings = std::env::var("KILN_PROBE_SETTINGS").unwrap_or_default();
    for head_dim in [64, 80, 96, 128] {
        for (q_len, kv_len, causal) in [(130, 130, false), (100, 37, true)] {
            let options = AttentionOptions { causal, ..Default::default() };
            let (qs, ks) = ([1, 4, q_len, head_dim], [1, 2, kv_len, head_dim]);
            let inputs = [common::random(&qs, 1), common::random(&ks, 2), common::random(&ks, 3), common::random(&qs, 5)];
            let oracle = attention_outputs::<burn::backend::NdArray<f64>>(false, true, &inputs, None, options, DType::F64, &Default::default());
            let row = if causal { q_len.saturating_sub(kv_len) * head_dim } else { 0 };
            for setting in settings.split(';') {
                let vars: Vec<(&str, &str)> = setting.split(',').filter_map(|kv| kv.split_once('=')).collect();
                // SAFETY: single-threaded here; the plan reads them at the next call.
                vars.iter().for_each(|(k, v)| unsafe { std::env::set_var(k, v) });
                let got = attention_outputs::<B>(true, true, &inputs, None, options, DType::BF16, device);
                let errors: Vec<String> = got.iter().zip(&oracle).zip(["out", "dq", "dk", "dv"]).skip(1).map(|((g, o), name)| {
                    let scale = o.iter().fold(0f64, |m, x| m.max(x.abs()));
                    let err = g.iter().zip(o).fold(0f64, |m, (a, b)| if a.is_finite() { m.max((a - b).abs()) } else { f64::INFINITY });
                    format!("{name} {:.2e}", err / scale)
                }).collect();
                let sample = |v: &[f64]| [0, 1, 2, 3, 16, 17, 64, 65].iter().map(|c| format!("{:+.3}", v[row + c])).collect::<Vec<_>>().join(" ");
                println!("probe attention backward hd{head_dim} {q_len}x{kv_len} causal={causal} [{setting}]: {}", errors.join("  "));
                println!("probe   dq row {}: kernel {}  oracle {}", row / head_dim, sample(&got[1]), sample(&oracle[1]));
                vars.iter().for_each(|(k, _)| unsafe { std::env::remove_var(k) });
            }
        }
    }
}

/// Flash attention at the FlashAttention-2 paper's shapes (batch × seq = 16k tokens, 2048 model
/// width), forward and backward TFLOP/s (backward counted as 2.5 × forward FLOPs), the memory
/// held for the backward at 16k, and one decoding step over a 32k cache. `forward_only` times the
/// forward alone at every shape.
pub(super) fn bench_attention(device: &CudaDevice, quick: bool, forward_only: bool) {
    let client = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(device);
    let shape = kiln_kernels::flash_attention::AttentionShape { batch: 4, q_heads: 16, kv_heads: 16, q_len: 4096, kv_len: 4096, head_dim: 128 };
    let features = kiln_kernels::flash_attention::AttentionFeatures { causal: true, window: None, softcap: None, bias: false };
    let plan = kiln_kernels::flash_attention::AttentionPlan::new(&client, shape, features, DType::BF16.into()).unwrap();
    let wgmma = std::env::var("KILN_ATTENTION").map_or(true, |v| v != "mma");
    let path = if wgmma { "warpgroup MMA (wgmma, sm_90a)".into() } else if plan.tensor_cores { format!("tensor cores (mma.sync m16n8k16), {} planes per cube", plan.planes) } else { "portable".into() };
    println!("bench attention path of forward and backward (bf16 prefill): {path}");
    let (head_dims, seqs): (&[usize], &[usize]) = if quick { (&[128], &[4096]) } else { (&[64, 128], &[1024, 4096, 8192, 16384]) };
    for &head_dim in head_dims {
        for &seq in seqs {
            for causal in [false, true] {
                let (batch, heads) = (16384 / seq, 2048 / head_dim);
                let q = rand([batch, heads, seq, head_dim], device);
                let k = rand([batch, heads, seq, head_dim], device);
                let v = rand([batch, heads, seq, head_dim], device);
                let d_out = rand([batch, heads, seq, head_dim], device);
                let options = AttentionOptions { causal, ..Default::default() };
                let flops = 4.0 * (batch * heads * seq * seq * head_dim) as f64 * if causal { 0.5 } else { 1.0 };
                let fwd = time_adaptive(device, 0.05, 100, || ops::flash_attention(q.clone(), k.clone(), v.clone(), None, options));
                if forward_only {
                    println!("bench kiln attention hd{head_dim} s{seq} b{batch} h{heads} causal={causal:<5} fwd {:8.3} ms {:6.1} TF/s", fwd * 1e3, flops / fwd / 1e12);
                    continue;
                }
                let saved = B::flash_attention_forward(q.clone().into_primitive().tensor(), k.clone().into_primitive().tensor(), v.clone().into_primitive().tensor(), None, options);
                let bwd = time_adaptive(device, 0.05, 100, || {
                    B::flash_attention_backward(q.clone().into_primitive().tensor(), k.clone().into_primitive().tensor(), v.clone().into_primitive().tensor(), None, saved.output.clone(), saved.lse.clone(), d_out.clone().into_primitive().tensor(), options)
                });
                println!(
                    "bench kiln attention hd{head_dim} s{seq} b{batch} h{heads} causal={causal:<5} fwd {:8.3} ms {:6.1} TF/s  bwd {:8.3} ms {:6.1} TF/s  fwd+bwd {:6.1} TF/s",
                    fwd * 1e3, flops / fwd / 1e12, bwd * 1e3, 2.5 * flops / bwd / 1e12, 3.5 * flops / (fwd + bwd) / 1e12
                );
            }
        }
    }

    if quick || forward_only {
        return;
    }
    // Memory held after the forward under autodiff (what the backward keeps), 16k tokens, 2 heads.
    let in_use = || bytes_in_use(device) / 1e9;
    let (heads, seq, d) = (2, 16384, 128);
    let inputs: Vec<Tensor<Ad, 4>> = (0..3).map(|_| Tensor::from_inner(rand([1, heads, seq, d], device)).require_grad()).collect();
    let base = in_use();
    let out = ops::flash_attention(inputs[0].clone(), inputs[1].clone(), inputs[2].clone(), None, AttentionOptions::causal());
    let kiln_gb = in_use() - base;
    drop(out);
    let naive = kiln::ops::flash_attention::reference::forward::<Ad>(
        inputs[0].clone().into_primitive().tensor(), inputs[1].clone().into_primitive().tensor(), inputs[2].clone().into_primitive().tensor(), None, AttentionOptions::causal(),
    );
    let naive_gb = in_use() - base;
    drop(naive);
    println!("bench attention memory after forward (autodiff), causal s{seq} h{heads} d{d} bf16: kiln {kiln_gb:.3} GB, naive (materialized scores) {naive_gb:.3} GB");
    drop(inputs);

    bench_decode(device);
}

/// One decoding step: one query token, 32 q heads over an 8-kv-head cache of 32768 positions.
pub(super) fn bench_decode(device: &CudaDevice) {
    let client = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(device);
    let features = kiln_kernels::flash_attention::AttentionFeatures { causal: true, window: None, softcap: None, bias: false };
    let (q_heads, kv_heads, d) = (32, 8, 128);
    // The 32k cache first; 8k and 128k separate the per-call cost from the per-byte one.
    // `attention-decode CACHE...` runs only the given cache lengths (for profiling one).
    let given: Vec<usize> = std::env::args().skip(2).filter_map(|a| a.parse().ok()).collect();
    let caches = if given.is_empty() { vec![32768, 8192, 131072] } else { given };
    for cache in caches {
        let q = rand([1, q_heads, 1, d], device);
        let k = rand([1, kv_heads, cache, d], device);
        let v = rand([1, kv_heads, cache, d], device);
        let shape = kiln_kernels::flash_attention::AttentionShape { batch: 1, q_heads, kv_heads, q_len: 1, kv_len: cache, head_dim: d };
        let plan = kiln_kernels::flash_attention::AttentionPlan::new(&client, shape, features, DType::BF16.into()).unwrap();
        println!("bench attention decode path: {}, {} planes, {} KV splits of {} keys", if plan.tensor_cores { "tensor cores" } else { "portable" }, plan.planes, plan.splits, plan.split_len);
        let call = || ops::flash_attention(q.clone(), k.clone(), v.clone(), None, AttentionOptions::causal());
        let t = time(device, 50, call);
        let bytes = 2.0 * (kv_heads * cache * d) as f64 * 2.0;
        println!("bench kiln attention decode q1 hq{q_heads} hk{kv_heads} cache{cache} d{d}: {:.1} us ({:.0} GB/s of K+V)", t * 1e6, bytes / t / 1e9);
        let (gpu, enqueue) = gpu_time_per_call::<B, _>(device, 300, call);
        println!("bench kiln attention decode cache{cache} GPU time: {:.1} us/call ({:.0} GB/s of K+V; 300 enqueued behind busy work in {:.1} ms)", gpu * 1e6, bytes / gpu / 1e9, enqueue * 1e3);
    }
}
