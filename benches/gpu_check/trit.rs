//! Packed trit vectors on the H100: every op against the host definition (integer equality, the
//! CI tests' check), a search over a million stored vectors checked against the host, and the
//! issue's table — similarity search of 1, 8 and 64 queries against 1M vectors of 10 000 trits,
//! bind and bundle throughput — next to torch (int8 and bf16) in `peers/trit.py`, same call.

use std::time::Instant;

use burn::backend::cuda::CudaDevice;
use burn::tensor::{DType, backend::Backend};
use burn_cubecl::{CubeBackend, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor};
use cubecl::cuda::CudaRuntime;
use kiln::ops::trit::{Metric, TritTensor, format};
use kiln_kernels::trit::{ScoreArgs, WordLayout, launch_planes_to_codes, launch_scores};

use super::common::trits::{check_ops, check_search, host_batch, ints};
use super::{B, HBM};

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;

/// Stored vectors and their length for the search table.
const STORED: usize = 1_000_000;
const LEN: usize = 10_000;

/// The CI tests' op check on CUDA; all-pairs scores and search for query counts that take each
/// tensor-core variant (1–8 tiles of 8 queries, a second group past 64); then search over 1M ×
/// 10 000 against the host for eight queries.
pub fn parity(device: &CudaDevice) -> bool {
    let start = Instant::now();
    let ops = std::panic::catch_unwind(|| {
        check_ops::<B>(device, &[1, 31, 32, 33, 1000, 65_537, 1_000_003], 5);
        check_ops::<B>(device, &[33, 10_000], 301);
    });
    println!("parity trit ops (lengths 1 … 1 000 003, 5 and 301 rows): {} ({:.1} s)", if ops.is_ok() { "ok" } else { "FAIL" }, start.elapsed().as_secs_f64());
    let start = Instant::now();
    let many = std::panic::catch_unwind(|| {
        for len in [1, 255, 257, 10_000, 65_537] {
            let hm = host_batch(4099, len, 0.5, 21);
            let memory = TritTensor::<B>::from_host(&hm, device).unwrap();
            for q in [2, 5, 13, 31, 64, 70] {
                let hq = host_batch(q, len, 0.3, 22);
                check_search::<B>(&memory, &hm, &TritTensor::<B>::from_host(&hq, device).unwrap(), &hq, &format!("len {len}, {q} queries"));
            }
        }
    });
    println!("parity trit search, 2 … 70 queries against 4099 rows of 1 … 65 537 trits: {} ({:.1} s)", if many.is_ok() { "ok" } else { "FAIL" }, start.elapsed().as_secs_f64());
    let start = Instant::now();
    let memory = TritTensor::<B>::random(STORED, LEN, 0.5, 5, device).unwrap();
    let queries = TritTensor::<B>::random(8, LEN, 0.5, 6, device).unwrap();
    let (hm, hq) = (memory.to_host(), queries.to_host());
    let mut ok = ops.is_ok() && many.is_ok();
    for metric in [Metric::Dot, Metric::Hamming] {
        let k = 10;
        let (scores, indices) = queries.search(&memory, metric, k);
        let (scores, indices) = (ints(scores), ints(indices));
        for (q, query) in hq.iter().enumerate() {
            let best = format::search(query, &hm, metric, k);
            let got: Vec<(usize, i64)> = (0..k).map(|j| (indices[q * k + j] as usize, scores[q * k + j])).collect();
            let pass = got == best;
            ok &= pass;
            println!("parity trit search 1M × {LEN} {metric:?} top-{k} query {q}: {} (best {:?})", if pass { "ok" } else { "FAIL" }, &got[..3]);
        }
    }
    println!("parity trit search: {:.1} s", start.elapsed().as_secs_f64());
    ok
}

/// The search table: scores alone and search (scores + top-10) per call, for 1 to 64 queries,
/// with the packed bytes' rate; then bind and bundle throughput in trits per second.
pub fn bench(device: &CudaDevice) {
    let memory = TritTensor::<B>::random(STORED, LEN, 0.5, 5, device).unwrap();
    let bytes = memory.bytes() as f64;
    for q in [1, 2, 3, 4, 5, 8, 64] {
        let queries = TritTensor::<B>::random(q, LEN, 0.5, 6, device).unwrap();
        for metric in [Metric::Dot, Metric::Hamming] {
            let scores = super::time_adaptive(device, 0.3, 200, || queries.similarity(&memory, metric));
            let search = super::time_adaptive(device, 0.3, 200, || queries.search(&memory, metric, 10));
            println!(
                "bench trit {metric:?} {q:>2} queries vs {STORED} × {LEN}: scores {:8.3} ms ({:5.0} GB/s packed, {:4.1}% of HBM) | search top-10 {:8.3} ms ({:4.1}% of HBM)",
                scores * 1e3,
                bytes / scores / 1e9,
                100.0 * bytes / scores / HBM,
                search * 1e3,
                100.0 * bytes / search / HBM
            );
        }
    }
    drop(memory);
    let rows = 100_000;
    let batch = TritTensor::<B>::random(rows, LEN, 0.5, 7, device).unwrap();
    let key = TritTensor::<B>::random(1, LEN, 1.0, 8, device).unwrap();
    let trits = (rows * LEN) as f64;
    let bytes = batch.bytes() as f64;
    let bind = super::time_adaptive(device, 0.3, 200, || batch.bind(&key));
    let bundle = super::time_adaptive(device, 0.3, 200, || batch.bundle());
    let permute = super::time_adaptive(device, 0.3, 200, || batch.permute(12_345));
    println!(
        "bench trit {rows} × {LEN}: bind with one key {:.3} ms ({:.2e} trits/s, {:.1}% of HBM read + write) | bundle {:.3} ms ({:.2e} trits/s, {:.1}% of HBM read) | permute {:.3} ms ({:.2e} trits/s)",
        bind * 1e3,
        trits / bind,
        100.0 * 2.0 * bytes / bind / HBM,
        bundle * 1e3,
        trits / bundle,
        100.0 * bytes / bundle / HBM,
        permute * 1e3,
        trits / permute
    );
}

/// The layout decision: the same search kernel on the same 1M × 10 000 vectors held as two
/// bit-planes (kiln's layout) and as 2-bit codes (16 trits a word, planes split by masks and
/// shifts), device time of 20 back-to-back launches on `CubeBackend`, 1 and 64 queries.
pub fn layout(device: &CudaDevice) {
    let memory = TritTensor::<Cube>::random(STORED, LEN, 0.5, 5, device).unwrap();
    let words: CubeTensor<CudaRuntime> = memory.words().clone().into_primitive();
    let client = words.client.clone();
    let codes_of = |t: &CubeTensor<CudaRuntime>| {
        let out = empty_device_contiguous_dtype(client.clone(), device.clone(), t.meta.shape().clone(), DType::I32);
        launch_planes_to_codes(&client, t.meta.num_elements() / 2, t.clone().into_array_arg(), out.clone().into_array_arg());
        out
    };
    let memory_codes = codes_of(&words);
    let width = words.meta.shape()[1];
    // Words per vector load as `trit_scores` picks them: a row of 10 000 trits (626 words) takes
    // pairs of words.
    let vector_size = if width.is_multiple_of(4) { 4 } else { 2 };
    for q in [1usize, 64] {
        let queries: CubeTensor<CudaRuntime> = TritTensor::<Cube>::random(q, LEN, 0.5, 6, device).unwrap().words().clone().into_primitive();
        let query_codes = codes_of(&queries);
        let scores = empty_device_contiguous_dtype(client.clone(), device.clone(), [q, STORED].into(), DType::I32);
        let mut results = Vec::new();
        for (layout, mem, qs) in [(WordLayout::Planes, &words, &queries), (WordLayout::Codes, &memory_codes, &query_codes)] {
            let launch = || {
                let args = ScoreArgs {
                    queries: qs.clone().into_array_arg(),
                    memory: mem.clone().into_array_arg(),
                    scores: scores.clone().into_array_arg(),
                    query_rows: q,
                    memory_rows: STORED,
                    vectors: width / vector_size,
                    vector_size,
                    metric: Metric::Dot,
                    pairwise: false,
                    layout,
                };
                launch_scores(&client, args);
            };
            launch();
            Cube::sync(device).unwrap();
            let start = Instant::now();
            for _ in 0..20 {
                launch();
            }
            Cube::sync(device).unwrap();
            let t = start.elapsed().as_secs_f64() / 20.0;
            results.push(t);
            let bytes = memory.bytes() as f64;
            println!("bench trit layout {layout:?} dot, {q:>2} queries vs {STORED} × {LEN}: {:.3} ms ({:.1}% of HBM)", t * 1e3, 100.0 * bytes / t / HBM);
        }
        println!("bench trit layout: 2-bit codes take {:.2}× the planes' time at {q} queries", results[1] / results[0]);
    }
}
