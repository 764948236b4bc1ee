//! Dense products on the H100: parity cases, the stream-ordering check, and the table of issue 5
//! (Burn's matmul as users get it, each cubek strategy, kiln's cuBLASLt path; torch runs in
//! `peers.py` in the same call).

use std::time::Instant;

use burn::backend::cuda::CudaDevice;
use burn::tensor::{DType, Distribution, Tensor};
use cubecl::cuda::CudaRuntime;
use kiln::ops;

use super::common::checks::{GemmCase, GemmKind};
use super::B;

/// The shapes of Llama linear layers: `M` tokens × (K, N).
pub const MS: [usize; 6] = [1, 16, 512, 2048, 8192, 16384];
pub const KNS: [(usize, usize); 4] = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 128256)];

/// Parity cases for the GPU: ragged and decode-sized shapes, transposed views, epilogues.
pub fn parity_cases() -> Vec<GemmCase> {
    let mm = |tl, tr, shared| GemmKind::Matmul { transpose_lhs: tl, transpose_rhs: tr, shared_rhs: shared };
    let case = |batch, m, k, n, kind, seed| GemmCase { batch, m, k, n, kind, seed };
    vec![
        case(1, 1, 4096, 512, GemmKind::Linear { bias: false, residual: false }, 1),
        case(2, 150, 1000, 700, GemmKind::Linear { bias: true, residual: true }, 2),
        case(1, 257, 333, 129, mm(false, false, false), 3),
        case(3, 65, 200, 90, mm(true, false, false), 4),
        case(2, 77, 128, 301, mm(false, true, true), 5),
        case(1, 33, 64, 17, mm(true, true, false), 6),
        case(4, 1, 512, 96, GemmKind::Linear { bias: true, residual: false }, 7),
    ]
}

fn cube_rand(shape: [usize; 2], dtype: DType, device: &CudaDevice) -> Tensor<B, 2> {
    Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
}

/// A product whose left operand is still being written by slow CubeCL kernels (~40 ms of chained
/// Burn matmuls) when kiln's cuBLASLt call is enqueued, and whose output the next CubeCL kernel
/// reads at once. Each trial scales its data differently, so reading the previous trial's buffers
/// (what a missing ordering does once the memory pool is warm) shows as a mismatch; the first,
/// untimed trial warms the pool and the autotuner. The last two trials run on a second thread,
/// whose CubeCL stream is another one (a new `StreamId`). Returns whether every trial matched
/// Burn's own chain. `KILN_GEMM_ORDER=unordered` is the negative control: this check must fail
/// under it.
pub fn ordering_check(device: &CudaDevice) -> bool {
    let order = ops::matmul::cublaslt_stream_order(device.index);
    println!("gemm ordering check: cuBLASLt stream order {order:?}");
    let slow = cube_rand([8192, 8192], DType::BF16, device);
    let w = cube_rand([4096, 1024], DType::BF16, device);
    let trial = |scale: f32| {
        let mut x = slow.clone();
        for _ in 0..8 {
            x = x.matmul(slow.clone()) * (1.0 / 90.5);
        }
        let x = x.slice([0..2048, 0..4096]) * scale;
        let kiln = ops::matmul(x.clone(), w.clone()) * 2.0 + 1.0;
        let burn = x.matmul(w.clone()) * 2.0 + 1.0;
        let (k, b) = (super::common::values(kiln), super::common::values(burn));
        let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
        let err = k.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
        (err, scale, err <= 0.02 * scale && k.iter().all(|v| v.is_finite()))
    };
    trial(0.5);
    let mut ok = true;
    let mut report = |t: usize, thread: &str, (err, scale, pass): (f64, f64, bool)| {
        println!("gemm ordering trial {t} ({thread}): max |kiln - burn| {err:.3e} (scale {scale:.3e}) {}", if pass { "ok" } else { "FAIL" });
        ok &= pass;
    };
    for t in 1..=2 {
        report(t, "main thread", trial(t as f32));
    }
    let second = std::thread::scope(|s| s.spawn(|| [3.0, 4.0].map(&trial)).join().expect("second thread"));
    for (t, outcome) in (3..).zip(second) {
        report(t, "second thread", outcome);
    }
    ok
}

fn tflops(m: usize, k: usize, n: usize, seconds: f64) -> f64 {
    2.0 * (m * k * n) as f64 / seconds / 1e12
}

/// Burn's `matmul` (fusion + autotune, as `Cuda` users get it) next to kiln's, per shape
/// (`KILN_BENCH_BURN=0`: kiln's alone, when Burn's column is already known).
pub fn bench(device: &CudaDevice, dtype: DType, quick: bool) {
    let with_burn = std::env::var("KILN_BENCH_BURN").as_deref() != Ok("0");
    let order = ops::matmul::cublaslt_stream_order(device.index);
    println!("bench gemm {dtype:?}: kiln path cuBLASLt, stream order {order:?} (TF32 for f32 unless KILN_GEMM_TF32=0)");
    let kns: &[(usize, usize)] = if quick { &KNS[..1] } else { &KNS };
    for &(k, n) in kns {
        let w = cube_rand([k, n], dtype, device);
        for m in MS {
            let x = cube_rand([m, k], dtype, device);
            let start = Instant::now();
            let burn = if with_burn { super::time_adaptive(device, 0.1, 500, || x.clone().matmul(w.clone())) } else { f64::NAN };
            let kiln = super::time_adaptive(device, 0.1, 500, || ops::matmul(x.clone(), w.clone()));
            println!(
                "bench gemm {dtype:?} m{m:<6} k{k:<6} n{n:<7} burn {:9.4} ms {:6.1} TF/s  kiln {:9.4} ms {:6.1} TF/s  kiln/burn {:5.2}x ({:.1} s)",
                burn * 1e3,
                tflops(m, k, n, burn),
                kiln * 1e3,
                tflops(m, k, n, kiln),
                burn / kiln,
                start.elapsed().as_secs_f64()
            );
            // Give the pool's pages back before the next, larger shape: at M = 16384 × 128256 the
            // outputs kept alive per sample (4.2 GB each in bf16) did not fit beside them.
            drop(x);
            super::sync_all(device);
            <B as burn::tensor::backend::Backend>::memory_cleanup(device);
        }
    }
}

/// The cost of each stream-ordering strategy: kiln's product at M = 1 and M = 8192 (4096²), to be
/// run once per `KILN_GEMM_ORDER` setting.
pub fn bench_order(device: &CudaDevice) {
    let order = ops::matmul::cublaslt_stream_order(device.index);
    let w = cube_rand([4096, 4096], DType::BF16, device);
    for m in [1, 8192] {
        let x = cube_rand([m, 4096], DType::BF16, device);
        let t = super::time_adaptive(device, 0.1, 500, || ops::matmul(x.clone(), w.clone()));
        println!("bench gemm order {order:?} m{m} k4096 n4096 bf16: {:.2} us {:.1} TF/s", t * 1e6, tflops(m, 4096, 4096, t));
    }
}

/// Every cubek strategy burn-cubecl's autotune may pick (and the async/TMA ones it does not), run
/// directly on `CubeBackend` tensors, at a few bf16 shapes.
pub fn bench_strategies(device: &CudaDevice) {
    use burn_cubecl::{CubeBackend, kernel::matmul::init_matmul_output, tensor::CubeTensor};
    use cubek::matmul::{
        components::tile::TileMatmulKind as K,
        definition::{MatmulElems, MatmulGlobalElems},
        launch::{Strategy as S, launch_ref},
        routines::{
            BlueprintStrategy as Bp, TileSizeSelection, double_buffering::DoubleBufferingArgs,
            double_unit::DoubleUnitSelectionArgs, ordered_double_buffering::OrderedSelectionArgs, simple::SimpleArgs,
        },
    };
    use cubek::std::InputBinding;
    type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
    // The strategy's own default arguments (each variant has its own argument type).
    macro_rules! d {
        () => {
            Bp::Inferred(Default::default())
        };
    }
    let strategies: Vec<(&str, S)> = vec![
        ("SimpleCyclicCmma", S::SimpleCyclicCmma(d!())),
        ("SimpleCyclicMma multi_rows", S::SimpleCyclicMma(Bp::Inferred(SimpleArgs { tile_matmul: K::Mma, multi_rows: true }))),
        ("DoubleCyclicMma specialized", S::DoubleCyclicMma(Bp::Inferred(DoubleBufferingArgs { tile_matmul: K::Mma, specialized: true }))),
        ("DoubleCyclicCmma", S::DoubleCyclicCmma(d!())),
        (
            "OrderedDoubleMma",
            S::OrderedDoubleMma(Bp::Inferred(OrderedSelectionArgs { tile_matmul: K::Mma, partition_k: Some(2), row_count: Some(8), rows_per_plane: Some(2) })),
        ),
        ("SpecializedCyclicMma", S::SpecializedCyclicMma(d!())),
        ("SimpleTmaMma", S::SimpleTmaMma(d!())),
        ("SpecializedTmaMma", S::SpecializedTmaMma(d!())),
        ("DoubleTmaMma", S::DoubleTmaMma(d!())),
        ("DoubleAsyncCyclicMma", S::DoubleAsyncCyclicMma(d!())),
        ("DoubleUnit", S::DoubleUnit(Bp::Inferred(DoubleUnitSelectionArgs { tile_size: TileSizeSelection::MaxTileSize }))),
        ("GemvPlaneParallel", S::GemvPlaneParallel(d!())),
    ];
    let prim = |shape: [usize; 2]| -> CubeTensor<CudaRuntime> {
        Tensor::<Cube, 2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(DType::BF16).into_primitive().tensor()
    };
    for (m, k, n) in [(16, 4096, 4096), (2048, 4096, 11008), (8192, 4096, 4096), (8192, 11008, 4096)] {
        let (x, w) = (prim([m, k]), prim([k, n]));
        let out = init_matmul_output(&x, &w, DType::BF16);
        for (name, strategy) in &strategies {
            let st = DType::BF16.into();
            let run = || {
                let mut elems = MatmulElems::from_globals(&MatmulGlobalElems { lhs: st, rhs: st, out: st });
                launch_ref(strategy, &out.client, InputBinding::new(x.clone().binding(), st), InputBinding::new(w.clone().binding(), st), out.clone().binding(), &mut elems)
            };
            let start = Instant::now();
            if let Err(e) = run() {
                println!("bench gemm strategy {name:<28} m{m} k{k} n{n}: unavailable ({})", format!("{e:?}").chars().take(100).collect::<String>());
                continue;
            }
            let t = super::time_adaptive(device, 0.1, 500, || run().is_ok());
            println!("bench gemm strategy {name:<28} m{m} k{k} n{n} bf16: {:9.4} ms {:6.1} TF/s ({:.1} s)", t * 1e3, tflops(m, k, n, t), start.elapsed().as_secs_f64());
        }
    }
}

/// Llama projections as layers on `Autodiff<Cuda>`, bf16: forward and backward (dX and dW) of
/// kiln's `nn::Linear` next to `burn::nn::Linear` (the same parameters), each step
/// `Σ (x·W)·dy` → gradients; the loss ops alone are timed too and subtracted in RESULTS. FLOPs of
/// a step: 3 × 2·m·k·n. Torch: `python3 gemm.py linear`.
pub fn bench_linear(device: &CudaDevice) {
    use burn::module::Param;
    type Ad = burn::backend::Autodiff<B>;
    let leaf = |shape: [usize; 2]| Tensor::<Ad, 2>::from_inner(cube_rand(shape, DType::BF16, device)).require_grad();
    for (m, k, n) in [(8192, 4096, 11008), (8192, 11008, 4096), (8192, 4096, 4096), (2048, 4096, 4096)] {
        let (x, dy, y_leaf) = (leaf([m, k]), leaf([m, n]).detach(), leaf([m, n]));
        let burn_linear = burn::nn::Linear { weight: Param::from_tensor(leaf([k, n])), bias: None };
        let kiln_linear = kiln::nn::Linear::from(burn_linear.clone());
        let step_flops = 3.0 * 2.0 * (m * k * n) as f64;
        // Ten calls per sample: every call's gradients stay alive until the sync (hundreds of MB).
        let loss = super::time_few(device, 10, || (y_leaf.clone() * dy.clone()).sum().backward());
        let burn = super::time_few(device, 10, || (burn_linear.forward(x.clone()) * dy.clone()).sum().backward());
        let kiln = super::time_few(device, 10, || (kiln_linear.forward(x.clone()) * dy.clone()).sum().backward());
        let rate = |t: f64| step_flops / (t - loss) / 1e12;
        println!(
            "bench linear fwd+bwd bf16 m{m} k{k} n{n}: loss ops {:.4} ms; burn {:.4} ms ({:.0} TF/s net); kiln {:.4} ms ({:.0} TF/s net); kiln/burn {:.2}x",
            loss * 1e3,
            burn * 1e3,
            rate(burn),
            kiln * 1e3,
            rate(kiln),
            (burn - loss) / (kiln - loss)
        );
    }
}

/// Where the time of a small product goes (bf16, M × 4096·4096, issue 5's host-bound rows), per
/// call, each timed three times interleaved (host timings on the GPU machine drift by ±20%
/// between runs): kiln's product through Burn's fusion (as `Cuda` users call it); the same with
/// the operands reshaped to rank 3 and back around it (what every product recorded before the
/// views moved into the op); the product on `CubeBackend` (no fusion); Burn's own matmul; one
/// Burn elementwise op on the same input (Burn's per-op floor). Then the GPU's own time per
/// product ([`super::gpu_time_per_call`]).
pub fn bench_host(device: &CudaDevice) {
    use burn_cubecl::CubeBackend;
    type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
    let order = ops::matmul::cublaslt_stream_order(device.index);
    let w = cube_rand([4096, 4096], DType::BF16, device);
    let wc = Tensor::<Cube, 2>::random([4096, 4096], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
    for m in [1usize, 16, 512] {
        let x = cube_rand([m, 4096], DType::BF16, device);
        let xc = Tensor::<Cube, 2>::random([m, 4096], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
        let rank3 = || ops::matmul(x.clone().reshape([1, m, 4096]), w.clone().reshape([1, 4096, 4096])).reshape([m, 4096]);
        let mut rows: [Vec<f64>; 5] = Default::default();
        for _ in 0..3 {
            rows[0].push(super::time_adaptive(device, 0.05, 2000, || ops::matmul(x.clone(), w.clone())));
            rows[1].push(super::time_adaptive(device, 0.05, 2000, rank3));
            rows[2].push(super::time_adaptive(device, 0.05, 2000, || ops::matmul(xc.clone(), wc.clone())));
            rows[3].push(super::time_adaptive(device, 0.05, 2000, || x.clone().matmul(w.clone())));
            rows[4].push(super::time_adaptive(device, 0.05, 2000, || x.clone() + 1.0));
        }
        let [kiln, old, cube, burn, add] = rows.map(|mut r| {
            r.sort_by(f64::total_cmp);
            r[1] * 1e6
        });
        println!(
            "bench gemm host {order:?} m{m} k4096 n4096 bf16 us/call: kiln {kiln:.1}  kiln with rank-3 reshapes around it {old:.1}  kiln on CubeBackend {cube:.1}  burn matmul {burn:.1}  burn x+1 {add:.1}"
        );
        let (gpu, enqueue) = super::gpu_time_per_call::<B, _>(device, 300, || ops::matmul(x.clone(), w.clone()));
        println!("bench gemm host m{m}: GPU {:.1} us/product (300 enqueued behind busy work in {:.1} ms)", gpu * 1e6, enqueue * 1e3);
    }
}

/// Set the path `KILN_GEMM` forces (read by every product as it runs).
fn force_path(path: &str) {
    // SAFETY: the GPU check is single-threaded where it switches paths, and every product of the
    // previous path has run (its results were read or synchronized) before the switch.
    unsafe { std::env::set_var("KILN_GEMM", path) }
}

/// Forward parity of decode-sized products on the skinny kernel in bf16, f16 and f32: kiln's
/// default path against cuBLASLt (`KILN_GEMM=cublaslt`, TF32 off) as the same-precision
/// reference, both against an f64 host product, with the memory pool poisoned first. Cases:
/// Llama-sized and ragged shapes, rows that are not a power of two, a batch with its own right
/// operands, a linear layer with bias and residual.
pub fn parity_skinny(device: &CudaDevice) -> bool {
    use super::common::{compare, poison, random, tensor, values};
    // SAFETY: as in `force_path`.
    unsafe { std::env::set_var("KILN_GEMM_TF32", "0") }
    // (batch, m, k, n, linear layer with bias and residual)
    let cases = [(1, 1, 4096, 4096, false), (1, 5, 1000, 1030, true), (3, 16, 2048, 700, false), (2, 9, 333, 129, false), (1, 2, 11008, 4101, true)];
    let mut ok = true;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (batch, m, k, n, linear) in cases {
            let start = Instant::now();
            let w_shape: &[usize] = if linear { &[k, n] } else { &[batch, k, n] };
            let (x, w, bias, res) = (random(&[batch, m, k], 1), random(w_shape, 2), random(&[n], 3), random(&[batch, m, n], 4));
            let host = |d: &burn::tensor::TensorData| d.clone().convert::<f64>().to_vec::<f64>().unwrap();
            // The oracle reads the inputs as stored in `dtype` (rounded), in f64.
            let stored = |d: &burn::tensor::TensorData| host(&d.clone().convert_dtype(dtype));
            let (xh, wh, bh, rh) = (stored(&x), stored(&w), stored(&bias), stored(&res));
            let oracle: Vec<f64> = (0..batch * m * n)
                .map(|at| {
                    let (b, i, j) = (at / (m * n), at / n % m, at % n);
                    let wb = if linear { 0 } else { b * k * n };
                    let dot: f64 = (0..k).map(|p| xh[(b * m + i) * k + p] * wh[wb + p * n + j]).sum();
                    if linear { dot + bh[j] + rh[at] } else { dot }
                })
                .collect();
            let run = |path: &str| {
                force_path(path);
                poison::<B>(device, 4 * batch * m * n, dtype);
                let xt = tensor::<B, 3>(&x, dtype, device);
                let y = if linear {
                    let wt = tensor::<B, 2>(&w, dtype, device);
                    ops::linear_residual(xt, wt, Some(tensor::<B, 1>(&bias, dtype, device)), tensor::<B, 3>(&res, dtype, device))
                } else {
                    ops::matmul(xt, tensor::<B, 3>(&w, dtype, device))
                };
                values(y)
            };
            let (kernel, reference) = (run("skinny"), run("cublaslt"));
            let c = compare("y", &kernel, &reference, &oracle, dtype, k as f64);
            println!(
                "parity skinny b{batch} m{m} k{k} n{n} linear={linear} {dtype:?}: kernel_err {:.3e} ref_err {:.3e} bound {:.3e} {} ({:.1} s)",
                c.kernel_err, c.reference_err, c.bound, if c.passed() { "ok" } else { "FAIL" }, start.elapsed().as_secs_f64()
            );
            ok &= c.passed();
        }
    }
    force_path("");
    ok
}

/// Decode-sized products (bf16, M rows over the Llama layer shapes; M = 1, 4, 16 unless given):
/// kiln's default path and cuBLASLt forced, per call as `Cuda` users call them, three interleaved
/// rounds (host timings on the GPU machine drift between runs); then kiln's product on
/// `CubeBackend` (no fusion) per call, and its GPU time per product there
/// ([`super::gpu_time_per_call`]) with the HBM bandwidth its bytes make. `KILN_SKINNY_*` set the
/// kernel's layout for measurements.
pub fn bench_skinny(device: &CudaDevice, ms: &[usize]) {
    use burn_cubecl::CubeBackend;
    type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
    let ms = if ms.is_empty() { &[1, 4, 16][..] } else { ms };
    let env = |name: &str| std::env::var(name).unwrap_or_default();
    println!("bench gemm skinny: columns={} splits={} units={}", env("KILN_SKINNY_COLUMNS"), env("KILN_SKINNY_SPLITS"), env("KILN_SKINNY_UNITS"));
    for &(k, n) in &KNS {
        let w = cube_rand([k, n], DType::BF16, device);
        let wc = Tensor::<Cube, 2>::random([k, n], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
        for &m in ms {
            let x = cube_rand([m, k], DType::BF16, device);
            let xc = Tensor::<Cube, 2>::random([m, k], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
            let product = || ops::matmul(x.clone(), w.clone());
            let direct = || ops::matmul(xc.clone(), wc.clone());
            let mut rows: [Vec<f64>; 3] = Default::default();
            for _ in 0..3 {
                force_path("");
                rows[0].push(super::time_adaptive(device, 0.05, 2000, product));
                rows[2].push(super::time_adaptive(device, 0.05, 2000, direct));
                force_path("cublaslt");
                rows[1].push(super::time_adaptive(device, 0.05, 2000, product));
            }
            let [kiln, cublaslt, cube] = rows.map(|mut r| {
                r.sort_by(f64::total_cmp);
                r[1]
            });
            force_path("");
            let (gpu, enqueue) = super::gpu_time_per_call::<Cube, _>(device, 300, direct);
            let bytes = 2.0 * (k * n + m * k + m * n) as f64;
            println!(
                "bench gemm skinny bf16 m{m:<3} k{k:<6} n{n:<7} us/call: kiln {:7.1}  cublaslt {:7.1}  kiln on CubeBackend {:7.1} | GPU {:7.1} us/product, {:5.0} GB/s ({:.1} us/call to enqueue)",
                kiln * 1e6,
                cublaslt * 1e6,
                cube * 1e6,
                gpu * 1e6,
                bytes / gpu / 1e9,
                enqueue / 300.0 * 1e6
            );
        }
    }
    force_path("");
}

/// Five products per Llama layer shape at `m` rows (bf16, `CubeBackend`, synchronized after each
/// shape): a short, fixed launch sequence for Nsight Compute (`gpu/profile.sh`) to time kernel
/// by kernel.
pub fn skinny_kernels(device: &CudaDevice, m: usize) {
    use burn_cubecl::CubeBackend;
    type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
    for &(k, n) in &KNS {
        let w = Tensor::<Cube, 2>::random([k, n], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
        let x = Tensor::<Cube, 2>::random([m, k], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
        let outs: Vec<_> = (0..5).map(|_| ops::matmul(x.clone(), w.clone())).collect();
        <Cube as burn::tensor::backend::Backend>::sync(device).unwrap();
        println!("skinny kernels m{m} k{k} n{n}: {} products", outs.len());
    }
}
