//! Timing on the GPU: per call through Burn's fusion (samples of many calls, every stream
//! synchronized at their end), the GPU's own time per call behind busy work, and the memory a
//! forward leaves for its backward.

use super::*;

/// Median seconds per call of `f` over five samples of `iters` calls (after three warm-up calls).
pub(super) fn time<T>(device: &CudaDevice, iters: usize, f: impl FnMut() -> T) -> f64 {
    time_samples(device, 3, 5, iters, f)
}

/// Median seconds per call of `f` over `samples` samples of `iters` calls each, after `warmups`
/// calls, waiting for every stream kiln uses at the end of each sample.
///
/// Results stay alive until the device has synced: Burn's fusion skips work whose results are
/// dropped unread, which would time nothing.
pub(super) fn time_samples<T>(device: &CudaDevice, warmups: usize, samples: usize, iters: usize, mut f: impl FnMut() -> T) -> f64 {
    let warm: Vec<T> = (0..warmups).map(|_| f()).collect();
    sync_all(device);
    drop(warm);
    let mut times: Vec<f64> = (0..samples)
        .map(|_| {
            let start = Instant::now();
            let results: Vec<T> = (0..iters).map(|_| f()).collect();
            sync_all(device);
            drop(results);
            start.elapsed().as_secs_f64() / iters as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[samples / 2]
}

/// Wait for CubeCL's stream and kiln's cuBLASLt stream (which only the unordered negative
/// control leaves running past CubeCL's).
pub(super) fn sync_all(device: &CudaDevice) {
    B::sync(device).unwrap();
    ops::matmul::cublaslt_synchronize(device.index);
}

/// Seconds per call of `f`, `iters` calls per sample, median of three samples after one warm-up.
pub(super) fn time_few<T>(device: &CudaDevice, iters: usize, f: impl FnMut() -> T) -> f64 {
    time_samples(device, 1, 3, iters, f)
}

/// Seconds per call with as many calls per sample as fit `target` seconds, at most `max_iters`
/// (results stay alive within a sample, so the cap bounds memory): median of three samples after
/// two warm-up calls and one timed probe call. One call per sample would add a host round trip
/// and the launch to every timing (0.55–0.65 ms on a 2.3 ms attention forward on the H100),
/// which the peers' event-timed loops do not pay.
pub(super) fn time_adaptive<T>(device: &CudaDevice, target: f64, max_iters: usize, mut f: impl FnMut() -> T) -> f64 {
    let warm: Vec<T> = (0..2).map(|_| f()).collect();
    sync_all(device);
    drop(warm);
    let start = Instant::now();
    let probe = f();
    sync_all(device);
    drop(probe);
    let iters = (target / start.elapsed().as_secs_f64()).clamp(3.0, max_iters as f64) as usize;
    // The probe was the last warm-up.
    time_samples(device, 0, 3, iters, f)
}

/// Bytes in use in the device's memory pool once the queued work has run.
pub(super) fn bytes_in_use(device: &CudaDevice) -> f64 {
    B::sync(device).unwrap();
    let client = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(device);
    client.memory_usage().map_or(f64::NAN, |u| u.bytes_in_use as f64)
}

/// The bytes a forward leaves in use until its backward (its output and what its graph saves),
/// and the output.
pub(super) fn held_by<T>(device: &CudaDevice, forward: impl FnOnce() -> T) -> (f64, T) {
    let before = bytes_in_use(device);
    let out = forward();
    (bytes_in_use(device) - before, out)
}

/// One product timed both ways: per call through Burn's fusion (`fused`, on `B`) and the GPU's
/// own time per call on `CubeBackend` (`cube`), with the host's time to enqueue one call there
/// (the GPU figure holds while that stays below it).
pub(super) struct Timed {
    pub(super) per_call: f64,
    pub(super) gpu: f64,
    pub(super) enqueue: f64,
}

pub(super) fn time_both<T, U>(device: &CudaDevice, fused: impl FnMut() -> T, cube: impl FnMut() -> U) -> Timed {
    const CALLS: usize = 300;
    let per_call = time_adaptive(device, 0.05, 2000, fused);
    let (gpu, enqueue) = gpu_time_per_call::<Cube, _>(device, CALLS, cube);
    Timed { per_call, gpu, enqueue: enqueue / CALLS as f64 }
}

/// The GPU's own time per call of `f`, where the host is slower than the GPU at small sizes:
/// `calls` calls enqueued behind ~40 ms of CubeCL work (a chain of 8192² bf16 matmuls, timed
/// alone first), and the drain timed; median of three. Also returns the host time to enqueue
/// them (the figure holds only if that is below the busy work's time). `BK` is the backend the
/// busy work runs on: under Burn's fusion (`B`) calls queued behind pending work may run on the
/// host only at the drain, so the drain of a host-bound op there is host time; on `CubeBackend`
/// every call launches as it is made.
pub(super) fn gpu_time_per_call<BK: burn::tensor::backend::Backend<Device = CudaDevice>, T>(device: &CudaDevice, calls: usize, mut f: impl FnMut() -> T) -> (f64, f64) {
    let slow = Tensor::<BK, 2>::random([8192, 8192], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
    let busy = || {
        let mut y = slow.clone();
        for _ in 0..6 {
            y = y.matmul(slow.clone()) * (1.0 / 90.5);
        }
        y
    };
    let sync = || {
        BK::sync(device).unwrap();
        ops::matmul::cublaslt_synchronize(device.index);
    };
    let alone = {
        let mut times: Vec<f64> = (0..4)
            .map(|_| {
                let start = Instant::now();
                let b = busy();
                sync();
                drop(b);
                start.elapsed().as_secs_f64()
            })
            .collect();
        times.remove(0);
        times.sort_by(f64::total_cmp);
        times[1]
    };
    let mut rows: Vec<(f64, f64)> = (0..3)
        .map(|_| {
            let start = Instant::now();
            let b = busy();
            let outs: Vec<T> = (0..calls).map(|_| f()).collect();
            let enqueued = start.elapsed().as_secs_f64();
            sync();
            let total = start.elapsed().as_secs_f64();
            drop((b, outs));
            ((total - alone) / calls as f64, enqueued)
        })
        .collect();
    rows.sort_by(|a, b| a.0.total_cmp(&b.0));
    rows[1]
}
