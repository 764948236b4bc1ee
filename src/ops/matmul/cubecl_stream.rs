//! CubeCL's own CUDA stream, learned through CUPTI (CUDA only).
//!
//! CubeCL 0.10 launches the kernels of each `StreamId` (one per host thread) on a `CUstream` it
//! keeps private. Work that kiln enqueues on that same stream is ordered against CubeCL's kernels
//! by CUDA itself: no handshake kernels, events or host waits. CUPTI, NVIDIA's profiling-tools
//! interface, hands a subscriber the arguments of every driver call it asks for, the stream of
//! `cuLaunchKernel` among them. [`launch_stream`] subscribes, lets CubeCL launch one kernel,
//! reads the stream that launch used and unsubscribes; CUPTI sees no other call of the process.
//!
//! CUPTI ships with the CUDA toolkit (`extras/CUPTI/lib64`) and with PyTorch's CUDA wheels, not
//! with the driver. Where it cannot be loaded, or a profiler already holds CUPTI's one subscriber
//! slot, [`launch_stream`] fails and the caller orders its work another way.

use std::ffi::{c_char, c_uint, c_void};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;

use cudarc::driver::sys as dsys;

/// `CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API`.
const DRIVER_API: u32 = 1;
/// `CUpti_ApiCallbackSite::CUPTI_API_ENTER`.
const API_ENTER: u32 = 0;
/// `CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel` (what cubecl-cuda calls) and `…_cuLaunchKernelEx`.
const LAUNCH_KERNEL: u32 = 307;
const LAUNCH_KERNEL_EX: u32 = 652;
/// `CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED`: another tool (a profiler) is subscribed.
const MULTIPLE_SUBSCRIBERS: i32 = 39;

type Subscriber = *mut c_void;
type Callback = unsafe extern "C" fn(*mut c_void, u32, u32, *const c_void);

/// `CUpti_CallbackData` (cupti_callbacks.h).
#[allow(dead_code)] // every field mirrors the C layout; only some are read
#[repr(C)]
struct CallbackData {
    site: u32,
    function_name: *const c_char,
    params: *const c_void,
    return_value: *mut c_void,
    symbol_name: *const c_char,
    context: dsys::CUcontext,
    context_uid: u32,
    correlation_data: *mut u64,
    correlation_id: u32,
}

/// `cuLaunchKernel_params` (generated_cuda_meta.h).
#[allow(dead_code)] // every field mirrors the C layout; only some are read
#[repr(C)]
struct LaunchKernelParams {
    function: dsys::CUfunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_bytes: c_uint,
    stream: dsys::CUstream,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
}

/// `cuLaunchKernelEx_params` (generated_cuda_meta.h).
#[allow(dead_code)] // every field mirrors the C layout; only some are read
#[repr(C)]
struct LaunchKernelExParams {
    config: *const dsys::CUlaunchConfig,
    function: dsys::CUfunction,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
}

/// The three CUPTI entry points kiln uses, from the loaded library.
struct Cupti {
    subscribe: unsafe extern "C" fn(*mut Subscriber, Callback, *mut c_void) -> i32,
    enable_callback: unsafe extern "C" fn(u32, Subscriber, u32, u32) -> i32,
    unsubscribe: unsafe extern "C" fn(Subscriber) -> i32,
    _library: libloading::Library,
}

/// Where CUPTI may be: the loader's search path, then the toolkit's `extras` folder.
fn library_candidates() -> Vec<PathBuf> {
    const NAMES: [&str; 3] = ["libcupti.so", "libcupti.so.13", "libcupti.so.12"];
    let roots = ["CUDA_HOME", "CUDA_PATH"].into_iter().filter_map(std::env::var_os).map(PathBuf::from).chain([PathBuf::from("/usr/local/cuda")]);
    let in_toolkit: Vec<PathBuf> = roots.flat_map(|root| NAMES.map(|n| root.join("extras/CUPTI/lib64").join(n))).collect();
    NAMES.iter().map(PathBuf::from).chain(in_toolkit).collect()
}

/// CUPTI, loaded once per process.
fn cupti() -> Result<&'static Cupti, String> {
    static CUPTI: OnceLock<Result<Cupti, String>> = OnceLock::new();
    CUPTI
        .get_or_init(|| {
            let candidates = library_candidates();
            // SAFETY: loading CUPTI runs no initialisation beyond its own library constructors.
            let library = candidates
                .iter()
                .find_map(|path| unsafe { libloading::Library::new(path) }.ok())
                .ok_or_else(|| format!("libcupti not found (looked for {candidates:?})"))?;
            // SAFETY: the signatures are those of cupti_callbacks.h; the library outlives them.
            unsafe {
                let subscribe = *library.get(b"cuptiSubscribe\0").map_err(|e| format!("{e}"))?;
                let enable_callback = *library.get(b"cuptiEnableCallback\0").map_err(|e| format!("{e}"))?;
                let unsubscribe = *library.get(b"cuptiUnsubscribe\0").map_err(|e| format!("{e}"))?;
                Ok(Cupti { subscribe, enable_callback, unsubscribe, _library: library })
            }
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Kernel launches seen while a probe is subscribed: the calling thread and the stream.
static SEEN: Mutex<Vec<(ThreadId, usize)>> = Mutex::new(Vec::new());
/// One probe at a time (they share [`SEEN`] and CUPTI's subscriber slot).
static PROBE: Mutex<()> = Mutex::new(());

/// CUPTI's callback: records the stream of each kernel launch as it enters the driver. Runs on the
/// thread that made the call, possibly any thread of the process; never panics.
unsafe extern "C" fn on_driver_call(_: *mut c_void, domain: u32, cbid: u32, data: *const c_void) {
    if domain != DRIVER_API || data.is_null() {
        return;
    }
    // SAFETY: CUPTI passes a `CUpti_CallbackData` for the driver domain, and the parameter block
    // of the call named by `cbid`, valid for the duration of the callback.
    let stream = unsafe {
        let data = &*(data as *const CallbackData);
        if data.site != API_ENTER || data.params.is_null() {
            return;
        }
        match cbid {
            LAUNCH_KERNEL => (*(data.params as *const LaunchKernelParams)).stream,
            LAUNCH_KERNEL_EX => match (*(data.params as *const LaunchKernelExParams)).config.as_ref() {
                Some(config) => config.hStream,
                None => return,
            },
            _ => return,
        }
    };
    if let Ok(mut seen) = SEEN.lock() {
        seen.push((std::thread::current().id(), stream as usize));
    }
}

fn check(result: i32, call: &str) -> Result<(), String> {
    match result {
        0 => Ok(()),
        MULTIPLE_SUBSCRIBERS => Err(format!("{call}: another CUPTI client (a profiler) is subscribed")),
        code => Err(format!("{call} failed with CUPTI error {code}")),
    }
}

/// The stream that the kernel launches made by `launch` on this thread go to. `launch` must issue
/// them before it returns (on CubeCL's device thread CubeCL launches at once; a flush makes sure).
/// `Err` when CUPTI is missing or taken, no launch was seen, or launches went to several streams.
pub(super) fn launch_stream(launch: impl FnOnce() -> Result<(), String>) -> Result<dsys::CUstream, String> {
    let cupti = cupti()?;
    let _one_probe = PROBE.lock().unwrap_or_else(|e| e.into_inner());
    let mut subscriber: Subscriber = std::ptr::null_mut();
    // SAFETY: CUPTI's documented calls; `on_driver_call` matches `CUpti_CallbackFunc`.
    check(unsafe { (cupti.subscribe)(&mut subscriber, on_driver_call, std::ptr::null_mut()) }, "cuptiSubscribe")?;
    SEEN.lock().unwrap_or_else(|e| e.into_inner()).clear();
    let launched = [LAUNCH_KERNEL, LAUNCH_KERNEL_EX]
        .into_iter()
        // SAFETY: a live subscriber.
        .try_for_each(|cbid| check(unsafe { (cupti.enable_callback)(1, subscriber, DRIVER_API, cbid) }, "cuptiEnableCallback"))
        .and_then(|()| launch());
    // SAFETY: the subscriber made above; after this CUPTI calls back no more.
    let unsubscribed = check(unsafe { (cupti.unsubscribe)(subscriber) }, "cuptiUnsubscribe");
    launched.and(unsubscribed)?;
    let me = std::thread::current().id();
    let streams: Vec<usize> = SEEN.lock().unwrap_or_else(|e| e.into_inner()).drain(..).filter(|&(t, _)| t == me).map(|(_, s)| s).collect();
    match streams.first() {
        None => Err("no kernel launch was seen".into()),
        Some(&stream) if stream != 0 && streams.iter().all(|&s| s == stream) => Ok(stream as dsys::CUstream),
        Some(_) => Err(format!("the probe's {} launches did not all go to one non-default stream", streams.len())),
    }
}
