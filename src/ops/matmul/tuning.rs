//! Timing cuBLASLt's candidate algorithms for a product (CUDA only): [`tune`], and the [`Gate`]
//! that holds a stream while short products' runs are queued.

use std::ffi::c_void;

use cudarc::driver::{result as drv, sys as dsys};

use super::cublaslt::err;

/// Runs of each candidate that [`tune`] times, after its warm-up run.
const TIMED_RUNS: usize = 3;

/// Products of at most this many flops are timed behind a [`Gate`]: short enough (~10 µs at
/// cuBLASLt's bf16 rate) that the host's enqueueing can outlast them. Longer ones are timed as
/// queued, as before the gate, whose picks for the QLoRA step's NF4 base products made that step
/// 0.05 ms slower (`benches/RESULTS.md`, forty-eighth session).
pub(super) const GATED_FLOPS: f64 = 8e9;

/// Time each candidate on the product's own operands (CUDA events on the product's stream) and
/// return the fastest. cuBLASLt's heuristic ranks by a model of the device; measuring its top
/// candidates once per shape is what PyTorch's TunableOp does. Every candidate first runs once,
/// which loads its code (lazy loading may wait for the context's streams, so never behind a held
/// one). Then, for a `gated` (short) product, the stream is held on a [`Gate`] while every
/// candidate's timed runs are queued, and released, so that the events time the GPU running them
/// back to back rather than the host enqueueing them. Timed as queued, a product of ~10 µs
/// measured its enqueueing: three of the four rank-r products of a LoRA step at 4096 × 4096 picked
/// kernels of 14.7–15.0 µs where the gated timing picks 12.0–12.8 (with cuBLASLt's split-k
/// reduction; `benches/RESULTS.md`, forty-eighth session). Where no gate can be made the runs
/// are timed as queued. Runs on the product's own lane, ordered after its producers; the runs
/// only write an output that is not an input (bias and residual make them idempotent), which the
/// real launch after this overwrites or which is scratch.
pub(super) fn tune<A: Copy>(stream: dsys::CUstream, candidates: &[A], gated: bool, run: impl Fn(&A) -> Result<(), String>) -> Result<A, String> {
    if candidates.len() == 1 {
        return Ok(candidates[0]);
    }
    let ready: Vec<A> = candidates.iter().copied().filter(|c| run(c).is_ok()).collect();
    // SAFETY: a live stream.
    unsafe { drv::stream::synchronize(stream) }.map_err(err)?;
    let mut events = Vec::with_capacity(ready.len());
    let timed = {
        let gate = gated.then(|| Gate::hold(stream).ok()).flatten();
        let queued = (|| -> Result<Vec<bool>, String> {
            let event = || drv::event::create(dsys::CUevent_flags::CU_EVENT_DEFAULT).map_err(err);
            let mut ran = Vec::with_capacity(ready.len());
            for candidate in &ready {
                events.push((event()?, event()?));
                let (start, end) = events[events.len() - 1];
                // SAFETY (both): live events and stream.
                unsafe { drv::event::record(start, stream) }.map_err(err)?;
                ran.push((0..TIMED_RUNS).all(|_| run(candidate).is_ok()));
                unsafe { drv::event::record(end, stream) }.map_err(err)?;
            }
            Ok(ran)
        })();
        drop(gate);
        queued
    };
    let best = timed.and_then(|ran| {
        // SAFETY: a live stream, its last work the events recorded above.
        unsafe { drv::stream::synchronize(stream) }.map_err(err)?;
        let mut best: Option<(f32, A)> = None;
        for ((candidate, &(start, end)), ok) in ready.iter().zip(&events).zip(ran) {
            // SAFETY: both events recorded and complete.
            let ms = unsafe { drv::event::elapsed(start, end) }.map_err(err)?;
            if ok && best.is_none_or(|(b, _)| ms < b) {
                best = Some((ms, *candidate));
            }
        }
        Ok(best)
    });
    for (start, end) in events {
        // SAFETY: events created above, no longer recorded or waited on.
        unsafe {
            let _ = drv::event::destroy(start);
            let _ = drv::event::destroy(end);
        }
    }
    best?.map(|(_, a)| a).ok_or_else(|| "no candidate algorithm ran".into())
}

/// A page-locked host word that holds a stream (`cuStreamWaitValue32`) until it is dropped, for
/// [`tune`]. Dropping it releases the stream, waits for the stream to pass the hold and frees the
/// word.
struct Gate {
    word: *mut u32,
    stream: dsys::CUstream,
}

impl Gate {
    /// Holds `stream` from here on. Call on CubeCL's device thread with its context current.
    fn hold(stream: dsys::CUstream) -> Result<Self, String> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `ptr` receives a fresh mapped allocation of 4 bytes.
        let alloc = unsafe { dsys::cuMemHostAlloc(&mut ptr, 4, dsys::CU_MEMHOSTALLOC_DEVICEMAP) };
        if alloc != dsys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostAlloc: {alloc:?}"));
        }
        let word = ptr as *mut u32;
        // SAFETY: 4 bytes allocated above, not yet seen by the device.
        unsafe { word.write_volatile(0) };
        let mut device = 0;
        // SAFETY: `ptr` is a mapped host allocation; `stream` is live.
        let held = unsafe {
            let mapped = dsys::cuMemHostGetDevicePointer_v2(&mut device, ptr, 0);
            if mapped == dsys::CUresult::CUDA_SUCCESS {
                dsys::cuStreamWaitValue32_v2(stream, device, 1, dsys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32)
            } else {
                mapped
            }
        };
        if held != dsys::CUresult::CUDA_SUCCESS {
            // SAFETY: allocated above; the stream never waited on it.
            unsafe { dsys::cuMemFreeHost(ptr) };
            return Err(format!("cuStreamWaitValue32: {held:?}"));
        }
        Ok(Self { word, stream })
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        // SAFETY: the word is ours until freed below, and the stream is past its wait once
        // synchronized.
        unsafe {
            self.word.write_volatile(1);
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            let _ = drv::stream::synchronize(self.stream);
            dsys::cuMemFreeHost(self.word as *mut c_void);
        }
    }
}
