//! Where the host's time goes in calls that are host-bound (issue 23's and 25's 512-row products,
//! decode-sized ops): each workload loops for a few seconds between `kiln_profile_start` and
//! `kiln_profile_stop` of `host_profile.so` (LD_PRELOAD), which samples the call stacks;
//! `host_profile.py` symbolizes them. Without the shim each workload only prints its time a call.

use super::*;
use std::ffi::{CString, c_char};

type Start = unsafe extern "C" fn(*const c_char);
type Stop = unsafe extern "C" fn() -> i32;

/// The shim's entry points, if it is preloaded.
fn shim() -> Option<(Start, Stop)> {
    let this = libloading::os::unix::Library::this();
    unsafe {
        let start = this.get::<Start>(b"kiln_profile_start\0").ok()?;
        let stop = this.get::<Stop>(b"kiln_profile_stop\0").ok()?;
        Some((*start, *stop))
    }
}

/// Runs `f` in batches of `batch` calls (outputs kept until each batch's sync: fusion skips work
/// whose results are dropped unread) for about `seconds`, sampled under `label`.
fn window<T>(device: &CudaDevice, label: &str, seconds: f64, batch: usize, mut f: impl FnMut() -> T) {
    let warm: Vec<T> = (0..batch).map(|_| f()).collect();
    sync_all(device);
    drop(warm);
    let shim = shim();
    let name = CString::new(label).unwrap();
    if let Some((start, _)) = shim {
        unsafe { start(name.as_ptr()) };
    }
    let (begin, mut calls) = (Instant::now(), 0usize);
    while begin.elapsed().as_secs_f64() < seconds {
        let outs: Vec<T> = (0..batch).map(|_| f()).collect();
        sync_all(device);
        drop(outs);
        calls += batch;
    }
    let per_call = begin.elapsed().as_secs_f64() / calls as f64;
    let samples = shim.map_or(-1, |(_, stop)| unsafe { stop() });
    println!("host-profile {label}: {calls} calls, {:.1} us/call, {samples} samples", per_call * 1e6);
}

/// The workloads named in `which` (all when empty): 512-row NF4, bf16 and W2A8 products, each
/// through Burn's fusion (`Cuda`) and, for NF4 and bf16, on `CubeBackend` directly; and a
/// decode-sized RMSNorm both ways.
pub fn run(device: &CudaDevice, which: &[String]) {
    let wants = |w: &str| which.is_empty() || which.iter().any(|a| a == w);
    let (m, k, n) = (512, 4096, 4096);
    if wants("nf4") || wants("nf4-cube") {
        let (w, wc) = (nf4::weight::<B>(k, n, device), nf4::weight::<Cube>(k, n, device));
        let (x, xc) = (bf16::<B, 2>([m, k], device), bf16::<Cube, 2>([m, k], device));
        if wants("nf4") {
            window(device, "nf4", 3.0, 200, || ops::matmul_4bit(x.clone(), &w));
        }
        if wants("nf4-cube") {
            window(device, "nf4-cube", 3.0, 200, || ops::matmul_4bit(xc.clone(), &wc));
        }
    }
    if wants("bf16") || wants("bf16-cube") {
        let (d, dc) = (bf16::<B, 2>([k, n], device), bf16::<Cube, 2>([k, n], device));
        let (x, xc) = (bf16::<B, 2>([m, k], device), bf16::<Cube, 2>([m, k], device));
        if wants("bf16") {
            window(device, "bf16", 3.0, 200, || ops::matmul(x.clone(), d.clone()));
        }
        if wants("bf16-cube") {
            window(device, "bf16-cube", 3.0, 200, || ops::matmul(xc.clone(), dc.clone()));
        }
    }
    if wants("ternary") {
        let w = ternary::weight::<B>(11008, 4096, device);
        let x = bf16::<B, 2>([m, 4096], device);
        window(device, "ternary", 3.0, 200, || ops::ternary_matmul(x.clone(), &w));
    }
    if wants("rms") || wants("rms-cube") {
        let (x, g) = (bf16::<B, 2>([1, 4096], device), bf16::<B, 1>([4096], device));
        let (xc, gc) = (bf16::<Cube, 2>([1, 4096], device), bf16::<Cube, 1>([4096], device));
        if wants("rms") {
            window(device, "rms", 3.0, 200, || ops::rms_norm(x.clone(), g.clone(), 1e-6));
        }
        if wants("rms-cube") {
            window(device, "rms-cube", 3.0, 200, || ops::rms_norm(xc.clone(), gc.clone(), 1e-6));
        }
    }
}
