//! LoRA on the H100: parity of the op (forward, every gradient, dropout) in f32/bf16 through
//! cuBLASLt, and a LoRA / QLoRA layer's training step (forward + backward) next to its base alone;
//! PEFT runs the same steps in `peers/lora.py` in the same call.

use burn::backend::{Autodiff, cuda::CudaDevice};
use burn::module::Param;
use burn::tensor::{DType, Distribution, Tensor};
use kiln::nn::{Linear, LinearLayer, LoraAdapter, LoraConfig, LoraLinear, Nf4Linear};
use kiln::ops::nf4::QuantType;

use super::common::adapters::{LoraCase, LoraLinearCase};
use super::B;

pub(super) type Ad = Autodiff<B>;

/// `v` rounded to `dtype` (f16, else bf16), as f64: the same-precision path's one rounding.
fn round_to(v: f32, dtype: DType) -> f64 {
    use burn::tensor::{bf16, f16};
    if dtype == DType::F16 { f16::from_f32(v).to_f64() } else { bf16::from_f32(v).to_f64() }
}

/// `Σ_k left(i, k) · right(k, j)` over `k < depth` for an `[m, n]` result on the host: the f64
/// oracle's sums and the same-precision path's f32 sums (of the rounded inputs, in `k` order).
fn host_product(m: usize, n: usize, depth: usize, left: &dyn Fn(usize, usize) -> f64, right: &dyn Fn(usize, usize) -> f64) -> (Vec<f64>, Vec<f32>) {
    let (mut exact, mut same) = (vec![0.0f64; m * n], vec![0.0f32; m * n]);
    for i in 0..m {
        for k in 0..depth {
            let a = left(i, k);
            for j in 0..n {
                let b = right(k, j);
                exact[i * n + j] += a * b;
                same[i * n + j] += a as f32 * b as f32;
            }
        }
    }
    (exact, same)
}

/// `(d_in, d_out)` of the Llama-7B projections the steps run at.
pub(super) const STEPS: [(usize, usize); 2] = [(4096, 4096), (4096, 11008)];
/// Tokens a step's input holds: 4096, or `KILN_LORA_TOKENS` (as `peers/lora.py` reads
/// `LORA_TOKENS`).
pub(super) fn tokens() -> usize {
    env_usize("KILN_LORA_TOKENS", 4096)
}

/// The adapters' rank: 16, or `KILN_LORA_RANK` (`peers/lora.py`: `LORA_RANK`).
pub(super) fn rank() -> usize {
    env_usize("KILN_LORA_RANK", 16)
}

fn env_usize(var: &str, default: usize) -> usize {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

pub fn parity_cases() -> Vec<LoraCase> {
    let case = |batch, m, d_in, d_out, rank, dropout, seed| LoraCase { batch, m, d_in, d_out, rank, scale: 2.0, dropout, seed };
    vec![
        case(1, 1, 4096, 4096, 16, 0.0, 1),
        case(2, 33, 1000, 257, 8, 0.1, 2),
        case(1, 512, 4096, 1024, 64, 0.0, 3),
        case(3, 17, 520, 96, 1, 0.25, 4),
        case(1, 2048, 1024, 1024, 16, 0.05, 5),
        // On CUDA in f16/bf16 these take the fused `dy` products: tokens and features off the
        // kernel's tiles, ranks 16 and 8 (an odd number of 8-column MMA tiles).
        case(1, 300, 512, 1000, 16, 0.0, 6),
        case(2, 129, 256, 4104, 8, 0.1, 7),
    ]
}

/// Cases of a LoRA layer over a float base in one op (`lora_linear`), run with `KILN_LORA_LINEAR=1`
/// ([`with_fused_layer`]) so that in f16/bf16 on Hopper the fused kernel takes shapes too small
/// for it to be chosen (`linear.cu`'s large shapes are the probe harness's): the first five take
/// it forward, and without a dropout also for the input gradient (a prior as its residual). `W`
/// as stored and transposed (the two layouts of each pass), ranks 8, 16 and 64, rows, columns and
/// a reduction off the tiles (k = 1000: a partial last block), a bias, a base that trains. The
/// last (rank 4) falls back to the composed products. These autotune Burn's reference products
/// on every new shape (minutes a case on a fresh machine); `lora-linear-parity` checks the kernel
/// itself in seconds.
pub fn linear_parity_cases() -> Vec<LoraLinearCase> {
    let case = |m, d_in, d_out, rank, seed| LoraLinearCase::new(2, m, d_in, d_out, rank, seed);
    vec![
        LoraLinearCase { bias: true, ..case(300, 640, 520, 16, 1) },
        LoraLinearCase { transposed: true, ..case(150, 1000, 1032, 64, 2) },
        LoraLinearCase { dropout: 0.1, bias: true, ..case(200, 776, 640, 8, 3) },
        LoraLinearCase { transposed: true, prior: true, ..case(300, 640, 640, 16, 4) },
        LoraLinearCase { bias: true, base_grad: true, ..case(260, 520, 776, 16, 5) },
        LoraLinearCase { bias: true, transposed: true, ..case(33, 1000, 264, 4, 6) },
    ]
}

/// A step's inputs: `x` `[tokens, d_in]` (tracked), the output gradient `[tokens, d_out]`, a bf16
/// base `Linear` `[d_in, d_out]` (N(0, 0.02²)) and its NF4 quantization (block 64, double
/// quantization).
pub(super) fn step_inputs(tokens: usize, d_in: usize, d_out: usize, device: &CudaDevice) -> (Tensor<Ad, 2>, Tensor<Ad, 2>, Linear<Ad>, Nf4Linear<Ad>) {
    let linear = Linear { weight: Param::from_tensor(bf16([d_in, d_out], 0.02, device)), bias: None };
    let nf4 = Nf4Linear::from_linear(&linear, QuantType::Nf4, 64, true);
    (bf16([tokens, d_in], 1.0, device).require_grad(), bf16([tokens, d_out], 1.0, device), linear, nf4)
}

pub(super) fn bf16(shape: [usize; 2], std: f64, device: &CudaDevice) -> Tensor<Ad, 2> {
    Tensor::<Ad, 2>::random(shape, Distribution::Normal(0.0, std), device).cast(DType::BF16)
}

/// A bf16 adapter with random `A` and `B` (a trained adapter's work; `B = 0` changes no cost).
pub(super) fn adapter(d_in: usize, d_out: usize, dropout: f64, device: &CudaDevice) -> LoraAdapter<Ad> {
    let rank = rank();
    let config = LoraConfig::new().with_rank(rank).with_alpha(2.0 * rank as f64).with_dropout(dropout);
    LoraAdapter::new(bf16([rank, d_in], 0.02, device), bf16([d_out, rank], 0.02, device), &config)
}

/// One training step of `layer` on `x`: forward, backward from `dy` through `(y · dy).sum()`;
/// returns `x`'s gradient.
fn train_step<L: LinearLayer<Ad>>(layer: &L, x: &Tensor<Ad, 2>, dy: &Tensor<Ad, 2>) -> Tensor<B, 2> {
    let grads = (layer.forward(x.clone()) * dy.clone()).sum().backward();
    x.grad(&grads).unwrap()
}

/// The loss ops alone, as a step wraps them: `(y · dy).sum()` and its backward to `y` (which
/// requires a gradient); returns `y`'s gradient.
pub(super) fn loss_step(y: &Tensor<Ad, 2>, dy: &Tensor<Ad, 2>) -> Tensor<B, 2> {
    let grads = (y.clone() * dy.clone()).sum().backward();
    y.grad(&grads).unwrap()
}

/// One training step of two layers on the same input (as q and k projections are): the second
/// layer's `dx` takes the first's as its prior. Returns `x`'s gradient.
fn pair_step<L: LinearLayer<Ad>>(layers: [&L; 2], x: &Tensor<Ad, 2>, dy: &Tensor<Ad, 2>) -> Tensor<B, 2> {
    let loss = |layer: &L| (layer.forward(x.clone()) * dy.clone()).sum();
    let grads = (loss(layers[0]) + loss(layers[1])).backward();
    x.grad(&grads).unwrap()
}

/// Seconds per [`train_step`] of `layer` on `x`.
pub(super) fn step<L: LinearLayer<Ad>>(layer: &L, x: &Tensor<Ad, 2>, dy: &Tensor<Ad, 2>, device: &CudaDevice) -> f64 {
    super::time_adaptive(device, 0.3, 100, || train_step(layer, x, dy))
}

/// Runs `f` with `KILN_LORA_LINEAR` set to `value` (`0`: a float base's LoRA layer as composed
/// products, not the fused kernel; `1`: the kernel on every shape it runs), then unset.
pub(super) fn with_fused_layer<T>(value: &str, f: impl FnOnce() -> T) -> T {
    // SAFETY: single-threaded here; the kernel's fit check reads the variable at the next call.
    unsafe { std::env::set_var("KILN_LORA_LINEAR", value) }
    let out = f();
    unsafe { std::env::remove_var("KILN_LORA_LINEAR") }
    out
}

/// A LoRA layer's step (bf16 base `Linear`, rank 16, with and without dropout 0.1) and a QLoRA
/// layer's (NF4 base), each next to its base alone, 4096 tokens ([`rank`] and [`tokens`] read
/// their variables); the loss ops' own time beside.
/// Then the LoRA step alternated with and without the fused layer kernel (`KILN_LORA_LINEAR=0`),
/// three rounds, each next to a base step of its own, and so two layers on one input
/// ([`pair_step`]: the second's `dx` has a prior).
pub fn bench_steps(device: &CudaDevice) {
    let (tokens, rank) = (tokens(), rank());
    for (d_in, d_out) in STEPS {
        let (x, dy, linear, nf4) = step_inputs(tokens, d_in, d_out, device);
        let y = dy.clone().require_grad();
        let loss_only = super::time_adaptive(device, 0.3, 100, || loss_step(&y, &dy));
        let base = step(&LoraLinear::frozen(linear.clone()), &x, &dy, device);
        let lora = step(&LoraLinear::frozen(linear.clone()).with_adapter(adapter(d_in, d_out, 0.0, device)), &x, &dy, device);
        let lora_dropout = step(&LoraLinear::frozen(linear.clone()).with_adapter(adapter(d_in, d_out, 0.1, device)), &x, &dy, device);
        let qbase = step(&LoraLinear::frozen(nf4.clone()), &x, &dy, device);
        let qlora = step(&LoraLinear::frozen(nf4).with_adapter(adapter(d_in, d_out, 0.0, device)), &x, &dy, device);
        let ms = |t: f64| t * 1e3;
        println!(
            "bench lora step t{tokens} k{d_in} n{d_out} r{rank} bf16: kiln base {:.3} ms, lora {:.3} ms (+{:.3}), lora+dropout0.1 {:.3} ms | nf4 base {:.3} ms, qlora {:.3} ms (+{:.3}) | loss ops {:.3} ms of each",
            ms(base),
            ms(lora),
            ms(lora - base),
            ms(lora_dropout),
            ms(qbase),
            ms(qlora),
            ms(qlora - qbase),
            ms(loss_only)
        );
        let layer = LoraLinear::frozen(linear.clone()).with_adapter(adapter(d_in, d_out, 0.0, device));
        let second = LoraLinear::frozen(linear.clone()).with_adapter(adapter(d_in, d_out, 0.0, device));
        let frozen = LoraLinear::frozen(linear.clone());
        let pair = |layers| super::time_adaptive(device, 0.3, 100, || pair_step(layers, &x, &dy));
        for round in 0..3 {
            let [fused, composed] = ["1", "0"].map(|value| {
                with_fused_layer(value, || {
                    let (base, lora) = (step(&frozen, &x, &dy, device), step(&layer, &x, &dy, device));
                    let (base_pair, lora_pair) = (pair([&frozen, &frozen]), pair([&layer, &second]));
                    format!(
                        "base {:.3} ms, lora {:.3} ms ({:.3}x); two on one input: base {:.3}, lora {:.3} ms ({:.3}x)",
                        ms(base),
                        ms(lora),
                        lora / base,
                        ms(base_pair),
                        ms(lora_pair),
                        lora_pair / base_pair
                    )
                })
            });
            println!("bench lora step t{tokens} k{d_in} n{d_out} r{rank} bf16 round {round}: fused layer {fused} | composed {composed}");
        }
    }
}

/// An [`Nf4Linear`] that shows its adapter only its forward (no packed weight): a QLoRA layer
/// around it adds the update to the 4-bit product as composed ops (`lora`), the path before
/// `lora_linear_4bit`, for the bench to alternate with that op.
#[derive(burn::module::Module, Clone, Debug)]
struct OwnForward<BK: burn::tensor::backend::Backend> {
    inner: Nf4Linear<BK>,
}

impl<BK: kiln::ops::nf4::Nf4Backend> LinearLayer<BK> for OwnForward<BK> {
    fn forward<const D: usize>(&self, x: Tensor<BK, D>) -> Tensor<BK, D> {
        self.inner.forward(x)
    }

    fn d_input(&self) -> usize {
        self.inner.d_input()
    }

    fn d_output(&self) -> usize {
        self.inner.d_output()
    }

    fn bias(&self) -> Option<Tensor<BK, 1>> {
        self.inner.bias()
    }

    fn dense_weight(&self, dtype: DType) -> Tensor<BK, 2> {
        self.inner.dense_weight(dtype)
    }
}

/// A QLoRA layer's step (NF4 base, [`rank`] 16, [`tokens`] 4096) as one op (`lora_linear_4bit`:
/// on Hopper the dequantized weight into the fused layer kernel), with `KILN_LORA_LINEAR=0` (the
/// same op without that kernel), and as the update added to the 4-bit product by a layer of its
/// own ([`OwnForward`]), each round next to its base's step, three rounds.
pub fn bench_qlora_rounds(device: &CudaDevice) {
    let (tokens, rank) = (tokens(), rank());
    for (d_in, d_out) in STEPS {
        let (x, dy, _, nf4) = step_inputs(tokens, d_in, d_out, device);
        let base = LoraLinear::frozen(nf4.clone());
        let layer = LoraLinear::frozen(nf4.clone()).with_adapter(adapter(d_in, d_out, 0.0, device));
        let composed = LoraLinear::frozen(OwnForward { inner: nf4 }).with_adapter(adapter(d_in, d_out, 0.0, device));
        let ms = |t: f64| t * 1e3;
        for round in 0..3 {
            let b = step(&base, &x, &dy, device);
            let fused = step(&layer, &x, &dy, device);
            let unfused = with_fused_layer("0", || step(&layer, &x, &dy, device));
            let old = step(&composed, &x, &dy, device);
            println!(
                "bench qlora step t{tokens} k{d_in} n{d_out} r{rank} bf16 round {round}: nf4 base {:.3} ms | lora_linear_4bit {:.3} ms ({:.3}x) | the same, KILN_LORA_LINEAR=0 {:.3} ms ({:.3}x) | update on the 4-bit product {:.3} ms ({:.3}x)",
                ms(b),
                ms(fused),
                fused / b,
                ms(unfused),
                unfused / b,
                ms(old),
                old / b
            );
        }
    }
}

/// `rounds` LoRA steps at 4096 → 4096 (4096 tokens, rank 16, bf16), each synchronized, after the
/// base alone as many times: for a profiler or `cuda_trace.so` to split a step's time by kernel.
pub fn step_trace(device: &CudaDevice, rounds: usize) {
    let tokens = tokens();
    let (x, dy) = (bf16([tokens, 4096], 1.0, device).require_grad(), bf16([tokens, 4096], 1.0, device));
    let linear = Linear { weight: Param::from_tensor(bf16([4096, 4096], 0.02, device)), bias: None };
    let base = LoraLinear::frozen(linear.clone());
    let lora = LoraLinear::frozen(linear).with_adapter(adapter(4096, 4096, 0.0, device));
    for (name, layer) in [("base", &base), ("lora", &lora)] {
        for _ in 0..3 {
            drop(train_step(layer, &x, &dy));
        }
        super::sync_all(device);
        let start = std::time::Instant::now();
        for _ in 0..rounds {
            drop(train_step(layer, &x, &dy));
            super::sync_all(device);
        }
        println!("bench lora trace {name} t{tokens} 4096 -> 4096: {:.3} ms a synchronized step over {rounds}", start.elapsed().as_secs_f64() * 1e3 / rounds as f64);
    }
}

/// The backward's `dy` products (`dh = s·dy·B`, `dB = s·dyᵀ·h`; fused on CUDA in f16/bf16) on
/// CUDA's `CubeBackend` against f64 on the host, next to the same-precision path of a GEMM (f32
/// sums of the rounded inputs, rounded once), under the error rule. `CubeBackend` itself, not
/// `Cuda`: under Burn's fusion the op runs inside LoRA's recorded backward, and a direct call takes
/// the trait's GEMM default. Seconds, where the op's autodiff parity compiles Burn's reference
/// kernels for minutes on a fresh machine. Cases: one token, tokens and features off the kernel's
/// tiles, ranks 8 and 16, a full 4096² product, and rank 32 (past `MAX_RANK`: the GEMM pair).
pub fn dy_parity(device: &CudaDevice) -> bool {
    use burn::tensor::TensorPrimitive;
    use kiln::ops::lora::LoraBackend;
    use super::Cube;
    use super::common::{compare, poison, random, tensor, values};

    let mut ok = true;
    for dtype in [DType::BF16, DType::F16] {
        for (tokens, out, r, seed) in [(1, 4096, 16, 1), (300, 1000, 16, 2), (258, 4104, 8, 3), (517, 96, 8, 4), (4096, 4096, 16, 5), (300, 1000, 32, 6)] {
            poison::<Cube>(device, 3 * tokens * out, dtype);
            // dh's and dB's scales differ, as where the forward kept `h` scaled.
            let scales = [2.0f32, 0.5];
            let [dy, h, b] = [[tokens, out], [tokens, r], [out, r]].map(|shape| tensor::<Cube, 2>(&random(&shape, seed * 7 + shape[1] as u64), dtype, device));
            let [dy_h, h_h, b_h] = [&dy, &h, &b].map(|t| values(t.clone()));
            let prim = |t: Tensor<Cube, 2>| t.into_primitive().tensor();
            let (dh, db) = Cube::lora_dy_products(prim(dy), prim(h), prim(b), scales);
            let kernel = [dh, db].map(|t| values(Tensor::<Cube, 2>::from_primitive(TensorPrimitive::Float(t))));
            // `(i, j)` of `dh` sums `dy[i, k] · B[k, j]` over `k < out`; of `dB`, `dy[k, i] · h[k, j]` over `k < tokens`.
            let products = |scale: f32, rows: usize, depth: usize, left: &dyn Fn(usize, usize) -> f64, right: &dyn Fn(usize, usize) -> f64| {
                let (exact, same) = host_product(rows, r, depth, left, right);
                (exact.iter().map(|e| scale as f64 * e).collect::<Vec<_>>(), same.iter().map(|s| round_to(scale * s, dtype)).collect::<Vec<_>>())
            };
            let dh_ref = products(scales[0], tokens, out, &|i, k| dy_h[i * out + k], &|k, j| b_h[k * r + j]);
            let db_ref = products(scales[1], out, tokens, &|i, k| dy_h[k * out + i], &|k, j| h_h[k * r + j]);
            for ((name, (exact, same)), got) in [("dh", dh_ref), ("db", db_ref)].into_iter().zip(&kernel) {
                let c = compare(name, got, &same, &exact, dtype, 1.0);
                println!(
                    "parity lora-dy t{tokens} out{out} r{r} {dtype:?} {name} kernel_err {:.3e} ref_err {:.3e} bound {:.3e} {}",
                    c.kernel_err, c.reference_err, c.bound, if c.passed() { "ok" } else { "FAIL" }
                );
                ok &= c.passed();
            }
        }
    }
    ok
}

/// The products that expand a rank-r operand to the full width (`out = dropout(s · L · R) + C`;
/// on CUDA in f16/bf16 the backward's dropped-out `dx` is one kernel, `kiln_kernels::lora::expand`,
/// the rest the GEMM) on CUDA's `CubeBackend` (as [`dy_parity`]) against f64 on the host, next to
/// the same-precision path (f32 sums of the rounded inputs, the dropout and the residual in f32,
/// rounded once), under the error rule. Cases: the forward's `base + s · h · Bᵀ` and the
/// backward's `dx = dropout(dh · A) + prior` with and without the dropout and the prior, one token,
/// tokens and features off the tiles, ranks 8 and 16, 4096², and rank 32 (past `MAX_RANK`: the
/// GEMM path).
pub fn expand_parity(device: &CudaDevice) -> bool {
    use burn::tensor::{Shape, TensorPrimitive};
    use kiln::ops::lora::{DropoutMask, ExpandSpec, LoraBackend};
    use super::Cube;
    use super::common::{compare, poison, random, tensor, values};

    let cases = [
        (4096, 4096, 16, true, true, 0.0),
        (300, 1000, 16, true, true, 0.0),
        (1, 4104, 8, true, true, 0.0),
        (4096, 4096, 16, false, false, 0.0),
        (517, 96, 8, false, true, 0.1),
        (258, 4104, 16, false, true, 0.25),
        (129, 256, 8, false, false, 0.1),
        (300, 1000, 32, false, true, 0.1),
    ];
    let mut ok = true;
    for dtype in [DType::BF16, DType::F16] {
        for (seed, &(tokens, n, r, transposed, with_residual, p)) in (1u64..).zip(&cases) {
            poison::<Cube>(device, 2 * tokens * n, dtype);
            let dropout = (p > 0.0).then(|| DropoutMask::new(p, seed));
            let spec = ExpandSpec { rhs_transposed: transposed, scale: if transposed { 2.0 } else { 1.0 }, dropout };
            let rhs_shape = if transposed { [n, r] } else { [r, n] };
            let input = |shape: [usize; 2], salt: u64, std: f64| tensor::<Cube, 2>(&random(&shape, seed * 7 + salt), dtype, device) * std;
            let (l, rhs, c) = (input([tokens, r], 1, 1.0), input(rhs_shape, 2, 0.25), with_residual.then(|| input([tokens, n], 3, 1.0)));
            let [l_h, rhs_h] = [&l, &rhs].map(|t| values(t.clone()));
            let c_h = c.as_ref().map(|t| values(t.clone()));
            let prim = |t: Tensor<Cube, 2>| t.into_primitive().tensor();
            let out = Cube::lora_expand(prim(l), prim(rhs), c.map(prim), spec, Shape::new([tokens, n]));
            let got = values(Tensor::<Cube, 2>::from_primitive(TensorPrimitive::Float(out)));
            let right = |k: usize, j: usize| if transposed { rhs_h[j * r + k] } else { rhs_h[k * n + j] };
            let (sums_exact, sums_same) = host_product(tokens, n, r, &|i, k| l_h[i * r + k], &right);
            let (mut exact, mut same) = (vec![0.0; tokens * n], vec![0.0; tokens * n]);
            for i in 0..tokens {
                for j in 0..n {
                    let (mut e, mut s) = (spec.scale as f64 * sums_exact[i * n + j], spec.scale * sums_same[i * n + j]);
                    if let Some(mask) = dropout {
                        let keep = if mask.keeps((i * n + j) as u32) { mask.scale } else { 0.0 };
                        (e, s) = (e * keep as f64, s * keep);
                    }
                    let residual = c_h.as_ref().map_or(0.0, |c| c[i * n + j]);
                    exact[i * n + j] = e + residual;
                    same[i * n + j] = round_to(s + residual as f32, dtype);
                }
            }
            let cmp = compare("out", &got, &same, &exact, dtype, r as f64);
            println!(
                "parity lora-expand t{tokens} n{n} r{r} transposed={transposed} residual={with_residual} dropout{p} {dtype:?} kernel_err {:.3e} ref_err {:.3e} bound {:.3e} {}",
                cmp.kernel_err, cmp.reference_err, cmp.bound, if cmp.passed() { "ok" } else { "FAIL" }
            );
            ok &= cmp.passed();
        }
    }
    ok
}

/// The fused layer kernel (`kiln_kernels::lora::linear`) through `CubeBackend`'s
/// `lora_linear_forward` (`y`) and `lora_linear_backward` (`dx`, no dropout; a prior gradient of
/// `x` as its residual in half the cases), forced
/// onto small ragged shapes with `KILN_LORA_LINEAR=1`, against f64 on the host next to the
/// same-precision path: f32 sums of the rounded inputs, the rank-r factor (`s · x · Aᵀ`, `s · dy ·
/// B`) rounded as the kernel reads it, rounded once. `CubeBackend` itself, with a host oracle:
/// the autodiff cases ([`linear_parity_cases`]) autotune Burn's reference products for minutes
/// on every new shape. Cases: `W` as stored and transposed (both layouts of each pass), a bias,
/// ranks 8–64, a reduction off the 64-wide blocks (1000, 776), rows and columns off the tiles.
pub fn linear_parity(device: &CudaDevice) -> bool {
    use burn::tensor::{TensorData, TensorPrimitive};
    use kiln::ops::lora::{LoraBackend, LoraSpec};
    use kiln::ops::nf4::Quantized4;
    use kiln_kernels::nf4::wgmma::MAX_ROWS as MAX_ROWS_DIRECT;
    use kiln_kernels::{cuda_source::FloatKind, lora::linear::serves};
    use super::Cube;
    use super::common::{compare, poison, random, tensor, values};

    let prim = |t: Tensor<Cube, 2>| t.into_primitive().tensor();
    let back = |t| values(Tensor::<Cube, 2>::from_primitive(TensorPrimitive::Float(t)));
    let scale = 2.0f32;
    let mut ok = true;
    with_fused_layer("1", || {
        for dtype in [DType::BF16, DType::F16] {
            // `packed`: an NF4 base (`lora_linear_4bit`, W `[d_out, d_in]` dequantized by the op
            // in the run's dtype): more rows than the 4-bit GEMM takes (the dequantized weight
            // into the fused kernel), 300 rows (the 4-bit GEMM, the update added after it) and 5
            // (the 4-bit GEMV).
            for (rows, d_in, d_out, r, with_bias, transposed, with_prior, packed, seed) in [
                (600, 640, 520, 16, true, false, false, false, 1u64),
                (300, 1000, 1032, 64, false, true, true, false, 2),
                (517, 776, 640, 8, true, true, false, false, 3),
                (9, 64, 72, 24, false, false, true, false, 4),
                (1100, 640, 520, 16, true, true, true, true, 5),
                (300, 1024, 1032, 64, false, true, false, true, 6),
                (5, 640, 776, 8, true, true, true, true, 7),
            ] {
                poison::<Cube>(device, 4 * rows * (d_in + d_out), dtype);
                let scaled = |shape: [usize; 2], seed: u64, by: f64| {
                    let v: Vec<f64> = random(&shape, seed).to_vec::<f64>().unwrap().iter().map(|v| v * by).collect();
                    tensor::<Cube, 2>(&TensorData::new(v, shape), dtype, device)
                };
                let x = scaled([rows, d_in], seed, 1.0);
                let stored = if transposed { [d_out, d_in] } else { [d_in, d_out] };
                let w_stored = scaled(stored, seed + 1, 1.0 / (d_in as f64).sqrt());
                let w4 = packed.then(|| Quantized4::quantize(w_stored.clone(), QuantType::Nf4, 64, true));
                let w = match &w4 {
                    Some(w4) => w4.dequantize(dtype).transpose(),
                    None if transposed => w_stored.clone().transpose(),
                    None => w_stored.clone(),
                };
                let a = scaled([r, d_in], seed + 2, 1.0 / (d_in as f64).sqrt());
                let b = scaled([d_out, r], seed + 3, 0.5);
                let dy = scaled([rows, d_out], seed + 4, 1.0);
                let bias = with_bias.then(|| scaled([1, d_out], seed + 5, 1.0));
                let prior = with_prior.then(|| scaled([rows, d_in], seed + 6, 1.0));
                let prior_h = prior.as_ref().map(|t| values(t.clone())).unwrap_or_else(|| vec![0.0; rows * d_in]);
                let [xh, wh, ah, bh, dyh] = [&x, &w, &a, &b, &dy].map(|t| values(t.clone()));
                let bias_h = bias.as_ref().map(|t| values(t.clone())).unwrap_or_else(|| vec![0.0; d_out]);
                let spec = LoraSpec { scale, dropout: None };
                let bias_prim = bias.map(|t| t.reshape([d_out]).into_primitive().tensor());
                let (y, g) = match &w4 {
                    Some(w4) => {
                        let (y, hs) = Cube::lora_linear_4bit_forward(prim(x.clone()), w4.primitive(), bias_prim, prim(a.clone()), prim(b.clone()), spec);
                        (y, Cube::lora_linear_4bit_backward(prim(x), hs, w4.primitive(), prim(a), prim(b), prim(dy), spec, prior.map(prim), true))
                    }
                    None => {
                        let (y, hs) = Cube::lora_linear_forward(prim(x.clone()), prim(w.clone()), bias_prim, prim(a.clone()), prim(b.clone()), spec);
                        (y, Cube::lora_linear_backward(prim(x), hs, prim(w), prim(a), prim(b), prim(dy), spec, prior.map(prim), true))
                    }
                };
                let (y, dx) = (back(y), back(g.x.expect("dx was asked for")));
                // Forward: hs = round(s · x · Aᵀ), y = x · W + hs · Bᵀ + bias.
                let (h_exact, h_same) = host_product(rows, r, d_in, &|i, k| xh[i * d_in + k], &|k, j| ah[j * d_in + k]);
                let hs_r: Vec<f64> = h_same.iter().map(|v| round_to(scale * v, dtype)).collect();
                let (base_exact, base_same) = host_product(rows, d_out, d_in, &|i, k| xh[i * d_in + k], &|k, j| wh[k * d_out + j]);
                let (up_exact, _) = host_product(rows, d_out, r, &|i, k| scale as f64 * h_exact[i * r + k], &|k, j| bh[j * r + k]);
                let (_, up_same) = host_product(rows, d_out, r, &|i, k| hs_r[i * r + k], &|k, j| bh[j * r + k]);
                let y_exact: Vec<f64> = (0..rows * d_out).map(|i| base_exact[i] + up_exact[i] + bias_h[i % d_out]).collect();
                let y_same: Vec<f64> = (0..rows * d_out).map(|i| round_to(base_same[i] + up_same[i] + bias_h[i % d_out] as f32, dtype)).collect();
                // Input gradient: dh = round(s · dy · B), dx = dy · Wᵀ + dh · A + prior.
                let (dh_exact, dh_same) = host_product(rows, r, d_out, &|i, k| dyh[i * d_out + k], &|k, j| bh[k * r + j]);
                let dh_r: Vec<f64> = dh_same.iter().map(|v| round_to(scale * v, dtype)).collect();
                let (gb_exact, gb_same) = host_product(rows, d_in, d_out, &|i, k| dyh[i * d_out + k], &|k, j| wh[j * d_out + k]);
                let (gu_exact, _) = host_product(rows, d_in, r, &|i, k| scale as f64 * dh_exact[i * r + k], &|k, j| ah[k * d_in + j]);
                let (_, gu_same) = host_product(rows, d_in, r, &|i, k| dh_r[i * r + k], &|k, j| ah[k * d_in + j]);
                let dx_exact: Vec<f64> = (0..rows * d_in).map(|i| gb_exact[i] + gu_exact[i] + prior_h[i]).collect();
                let dx_same: Vec<f64> = (0..rows * d_in).map(|i| round_to(gb_same[i] + gu_same[i] + prior_h[i] as f32, dtype)).collect();
                // The path each pass takes (the device and alignment hold here): the kernel's fit.
                let kind = if dtype == DType::F16 { FloatKind::F16 } else { FloatKind::Bf16 };
                let fused = |n, k| if serves(kind, [rows, n, k, r], 132) { "fused" } else { "composed" };
                let forward = if packed && rows <= MAX_ROWS_DIRECT { "4-bit product + update" } else { fused(d_out, d_in) };
                for (name, got, same, exact, path) in [("y", &y, &y_same, &y_exact, forward), ("dx", &dx, &dx_same, &dx_exact, fused(d_in, d_out))] {
                    let c = compare(name, got, same, exact, dtype, 1.0);
                    println!(
                        "parity lora-linear t{rows} in{d_in} out{d_out} r{r} bias={with_bias} transposed={transposed} prior={with_prior} nf4={packed} {dtype:?} {name} ({path}) kernel_err {:.3e} ref_err {:.3e} bound {:.3e} {}",
                        c.kernel_err, c.reference_err, c.bound, if c.passed() { "ok" } else { "FAIL" }
                    );
                    ok &= c.passed();
                }
            }
        }
    });
    ok
}
