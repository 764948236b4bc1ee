//! Ordering cuBLASLt's work against CubeCL's stream (CUDA only).
//!
//! CubeCL 0.10 keeps the `CUstream` it launches on private (no accessor on `ComputeClient` or
//! `CudaServer`), one stream per `StreamId` (host thread). Four strategies ([`StreamOrder`],
//! `KILN_GEMM_ORDER`):
//!
//! - [`StreamOrder::SameStream`] (default): the stream is learned once per `StreamId` through
//!   CUPTI (`cubecl_stream.rs`) and cuBLASLt runs on it, ordered by CUDA like any CubeCL kernel.
//!   Each such stream gets its own cuBLASLt workspace (products of two threads may overlap).
//! - [`StreamOrder::DeviceHandshake`] (where CUPTI is missing or held by a profiler): kiln's own
//!   stream, and both streams meet in device memory, with no host wait. A one-unit CubeCL kernel
//!   ([`kiln_kernels::stream_handshake`]) on CubeCL's stream signals *ready* (everything CubeCL
//!   enqueued before it has finished) and spins until *done*; kiln's stream spins until *ready*,
//!   runs the product, writes *done*. The driver's stream memory operations
//!   (`cuStreamWaitValue32`) would be simpler but reject CubeCL's stream-ordered pool memory
//!   (`CUDA_ERROR_INVALID_VALUE` on the H100, driver 580).
//! - [`StreamOrder::HostSync`]: the host waits for CubeCL's stream, enqueues the product, waits
//!   for it (two host round trips per product). Used where neither of the above works, and by the
//!   handshake for every product that may load GPU code lazily (see [`Ordering::ordered`]).
//! - [`StreamOrder::Unordered`]: the negative control of the GPU check's ordering test.
//!
//! All rounds run on CubeCL's device thread (`cublaslt.rs` calls in through
//! `ComputeClient::exclusive`), where CubeCL issues a launch at once; from any other thread it
//! only queues the launch until something flushes the queue, and work on another stream would be
//! enqueued before CubeCL's (why the handshake's first attempt, run from the caller's thread,
//! never completed a round). Rounds do not call `ComputeClient::flush` (0.15-0.3 ms on the H100:
//! it also settles CubeCL's deferred frees).

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::{Duration, Instant};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::{ArrayArg, ComputeClient};
use cubecl::server::Handle;
use cubecl::stream_id::StreamId;
use cudarc::driver::{result as drv, sys as dsys};
use kiln_kernels::stream_handshake::{DONE, READY, SLOT_WORDS, launch_handshake};

use super::cubecl_stream::launch_stream;
use super::cublaslt::err;

/// How cuBLASLt's work is ordered against CubeCL's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamOrder {
    /// On CubeCL's own stream (learned through CUPTI): CUDA orders it, nothing else runs.
    SameStream,
    /// On kiln's stream, with device-side waits on flag words (no host synchronization).
    DeviceHandshake,
    /// On kiln's stream; the host waits for CubeCL's stream before the product and for the
    /// product after it.
    HostSync,
    /// No ordering at all: wrong results whenever a producer or consumer overlaps the product.
    /// Exists only as the negative control of the GPU check's ordering test
    /// (`KILN_GEMM_ORDER=unordered`), which must fail with it.
    Unordered,
}

/// `KILN_GEMM_ORDER=handshake|sync|unordered`; the same stream otherwise.
fn requested() -> StreamOrder {
    match std::env::var("KILN_GEMM_ORDER").as_deref() {
        Ok("unordered") => StreamOrder::Unordered,
        Ok("sync") => StreamOrder::HostSync,
        Ok("handshake") => StreamOrder::DeviceHandshake,
        _ => StreamOrder::SameStream,
    }
}

/// Where one product is enqueued: a stream, and a cuBLASLt workspace no other stream uses.
#[derive(Clone, Copy)]
pub(super) struct Lane {
    pub(super) stream: dsys::CUstream,
    pub(super) workspace: dsys::CUdeviceptr,
}

/// The ordering strategy of one device, with the state it needs.
pub(super) struct Ordering {
    order: StreamOrder,
    /// kiln's own stream (every strategy but [`StreamOrder::SameStream`]).
    own: Lane,
    workspace_size: usize,
    handshake: Option<Handshake>,
    /// CubeCL's stream of each `StreamId` (host thread) seen so far ([`StreamOrder::SameStream`]),
    /// or why it could not be learned (kept, so a failed probe is not repeated on every product).
    cubecl_streams: HashMap<u64, Result<dsys::CUstream, String>>,
    /// The workspace of each of those streams. Keyed by stream, not thread: CubeCL maps threads
    /// onto a bounded set of streams, so threads that come and go add no workspaces.
    workspaces: HashMap<usize, dsys::CUdeviceptr>,
}

/// CubeCL's stream for the calling `StreamId` (on CubeCL's device thread), learned by watching a
/// handshake kernel whose *done* word is already set, so it returns at once.
pub(crate) fn learn_cubecl_stream(client: &ComputeClient<CudaRuntime>) -> Result<dsys::CUstream, String> {
    const PROBE: u32 = 1;
    let flags = client.create_from_slice(&[PROBE.to_le_bytes(), PROBE.to_le_bytes()].concat());
    launch_stream(|| {
        // SAFETY: `flags` holds one slot of SLOT_WORDS u32 words.
        launch_handshake(client, unsafe { ArrayArg::from_raw_parts(flags.clone(), SLOT_WORDS) }, 0, PROBE);
        client.flush().map_err(err)
    })
}

impl Ordering {
    /// The requested strategy if it works on this device, else the next one down (said once on
    /// stderr): CubeCL's stream, the handshake after it passed its self-test, host
    /// synchronization. Runs on CubeCL's device thread.
    pub(super) fn new(client: &ComputeClient<CudaRuntime>, own: Lane, workspace_size: usize) -> Self {
        let mut ordering = Self { order: requested(), own, workspace_size, handshake: None, cubecl_streams: HashMap::new(), workspaces: HashMap::new() };
        if ordering.order == StreamOrder::SameStream {
            match ordering.cubecl_lane(client) {
                Ok(_) => return ordering,
                Err(e) => {
                    eprintln!("kiln::matmul: CubeCL's stream could not be learned ({e}); ordering cuBLASLt by a device handshake");
                    ordering.order = StreamOrder::DeviceHandshake;
                }
            }
        }
        if ordering.order == StreamOrder::DeviceHandshake {
            match Handshake::new(client, own.stream) {
                Ok(h) => ordering.handshake = Some(h),
                Err(e) => {
                    eprintln!("kiln::matmul: the cuBLASLt stream handshake failed its self-test ({e}); using host synchronization");
                    ordering.order = StreamOrder::HostSync;
                }
            }
        }
        ordering
    }

    pub(super) fn order(&self) -> StreamOrder {
        self.order
    }

    /// kiln's own stream.
    pub(super) fn own_stream(&self) -> dsys::CUstream {
        self.own.stream
    }

    /// CubeCL's stream for the calling `StreamId` (propagated onto CubeCL's device thread), learned
    /// on its first use by watching a handshake kernel whose *done* word is already set, so it
    /// returns at once; with the stream's own workspace.
    fn cubecl_lane(&mut self, client: &ComputeClient<CudaRuntime>) -> Result<Lane, String> {
        let id = StreamId::current().value;
        let stream = self
            .cubecl_streams
            .entry(id)
            .or_insert_with(|| learn_cubecl_stream(client))
            .clone()?;
        let workspace = match self.workspaces.get(&(stream as usize)) {
            Some(&workspace) => workspace,
            None => {
                // SAFETY: a plain device allocation, kept for the process like kiln's own workspace.
                let workspace = unsafe { drv::malloc_sync(self.workspace_size) }.map_err(err)?;
                self.workspaces.insert(stream as usize, workspace);
                workspace
            }
        };
        Ok(Lane { stream, workspace })
    }

    /// Run `work` (which enqueues on the lane it is given; called on CubeCL's device thread)
    /// after everything enqueued so far on `client`'s stream, and before anything CubeCL enqueues
    /// later. `may_load_code`: `work` may load GPU code lazily (a new cuBLASLt plan's first
    /// launch); CUDA may synchronize the whole context to load code, which inside a handshake
    /// would wait on a kernel that waits for the product, so such work runs under host
    /// synchronization there.
    pub(super) fn ordered(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        may_load_code: bool,
        work: impl FnOnce(Lane) -> Result<(), String>,
    ) -> Result<(), String> {
        let own = self.own;
        match (self.order, &mut self.handshake) {
            (StreamOrder::SameStream, _) => match self.cubecl_lane(client) {
                Ok(lane) => work(lane),
                Err(e) => {
                    warn_once(&format!("kiln::matmul: CubeCL's stream for this thread could not be learned ({e}); this thread's products use host synchronization"));
                    host_sync(client, own, work)
                }
            },
            (StreamOrder::Unordered, _) => work(own),
            (StreamOrder::DeviceHandshake, Some(h)) if !may_load_code => h.round(client, own.stream, || work(own)),
            _ => host_sync(client, own, work),
        }
    }
}

/// `message` on stderr, the first time only.
fn warn_once(message: &str) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| eprintln!("{message}"));
}

fn host_sync(client: &ComputeClient<CudaRuntime>, own: Lane, work: impl FnOnce(Lane) -> Result<(), String>) -> Result<(), String> {
    cubecl::future::block_on(client.sync()).map_err(err)?;
    let result = work(own);
    // SAFETY: kiln's own live stream.
    unsafe { drv::stream::synchronize(own.stream) }.map_err(err)?;
    result
}

/// kiln's half of the handshake: two one-thread kernels on kiln's stream (CubeCL kernels can only
/// be launched on CubeCL's stream).
const SYNC_KERNELS: &str = r#"
extern "C" __global__ void kiln_wait_ready(unsigned int* flag, unsigned int nonce) {
    while (atomicAdd(flag, 0u) != nonce) {}
}
extern "C" __global__ void kiln_signal_done(unsigned int* flag, unsigned int nonce) {
    __threadfence();
    atomicExch(flag, nonce);
}
"#;

/// [`SYNC_KERNELS`], compiled with NVRTC and loaded once per device.
struct SyncKernels {
    wait_ready: dsys::CUfunction,
    signal_done: dsys::CUfunction,
}

impl SyncKernels {
    fn new() -> Result<Self, String> {
        let ptx = cudarc::nvrtc::compile_ptx(SYNC_KERNELS).map_err(err)?;
        let image = std::ffi::CString::new(ptx.to_src()).map_err(err)?;
        // SAFETY: a NUL-terminated PTX image; the module stays loaded for the process.
        unsafe {
            let module = drv::module::load_data(image.as_ptr() as *const c_void).map_err(err)?;
            let function = |name: &str| drv::module::get_function(module, std::ffi::CString::new(name).expect("no NUL")).map_err(err);
            Ok(Self { wait_ready: function("kiln_wait_ready")?, signal_done: function("kiln_signal_done")? })
        }
    }

    /// Launch `f(flag, nonce)` on one thread of `stream`.
    fn launch(f: dsys::CUfunction, stream: dsys::CUstream, flag: u64, nonce: u32) -> Result<(), String> {
        let (mut flag, mut nonce) = (flag, nonce);
        let mut params = [&mut flag as *mut u64 as *mut c_void, &mut nonce as *mut u32 as *mut c_void];
        // SAFETY: `f` takes (unsigned int*, unsigned int); the parameters outlive the call.
        unsafe { drv::launch_kernel(f, (1, 1, 1), (1, 1, 1), 0, stream, &mut params) }.map_err(err)
    }
}

/// Handshake slots in flight at once before the host waits for the oldest.
const SLOTS: usize = 256;

/// The handshake: kiln's kernels and a persistent ring of flag slots, each slot with an event
/// that keeps its handshakes from overlapping.
struct Handshake {
    kernels: SyncKernels,
    /// The flag words (`SLOTS × SLOT_WORDS` u32); holding the handle keeps CubeCL from reusing them.
    ring: Handle,
    base: u64,
    /// The last nonce handed out (never 0: a zeroed word matches no handshake).
    nonce: u32,
    /// Per slot, an event recorded after its last *done* write.
    pending: Vec<Option<dsys::CUevent>>,
}

impl Handshake {
    /// The handshake after it has been seen to work on this device, which also loads every
    /// kernel it uses (so none loads lazily inside a round): kiln's two kernels on a word of slot
    /// 0, the CubeCL half alone on slot 0 (its *done* word already written), then a full round.
    /// A failure (a launch error, a flag not written, a round not finished within 5 s) is an
    /// `Err`.
    fn new(client: &ComputeClient<CudaRuntime>, stream: dsys::CUstream) -> Result<Self, String> {
        const PROBE: u32 = u32::MAX;
        let kernels = SyncKernels::new()?;
        let ring = client.create_from_slice(&vec![0u8; SLOTS * SLOT_WORDS * size_of::<u32>()]);
        let base = client.get_resource(ring.clone()).map_err(err)?.resource().ptr;
        // The zeros must land before kiln's stream writes into the ring.
        cubecl::future::block_on(client.sync()).map_err(err)?;
        let mut h = Self { kernels, ring, base, nonce: 1, pending: vec![None; SLOTS] };

        SyncKernels::launch(h.kernels.signal_done, stream, h.word(0, DONE), PROBE)?;
        SyncKernels::launch(h.kernels.wait_ready, stream, h.word(0, DONE), PROBE)?;
        // SAFETY: kiln's live stream.
        unsafe { drv::stream::synchronize(stream) }.map_err(err)?;
        h.launch_cubecl_half(client, 0, PROBE);
        client.flush().map_err(|e| format!("CubeCL half of the handshake: {e:?}"))?;
        let words = client.read_one(h.ring.clone()).map_err(err)?;
        if words[READY * 4..READY * 4 + 4] != PROBE.to_le_bytes() {
            return Err("the CubeCL half did not signal ready".into());
        }

        let ok = h.round(client, stream, || Ok(())).and_then(|()| client.flush().map_err(err));
        let (slot, nonce) = (h.nonce as usize % SLOTS, h.nonce);
        let deadline = Instant::now() + Duration::from_secs(5);
        // SAFETY (all calls): kiln's live stream; the ring's words are live device memory.
        while ok.is_ok() && unsafe { dsys::cuStreamQuery(stream) } == dsys::CUresult::CUDA_ERROR_NOT_READY {
            if Instant::now() > deadline {
                // Release both spinning kernels before giving up.
                unsafe {
                    let _ = drv::memcpy_htod_sync(h.word(slot, READY), &[nonce]);
                    let _ = drv::memcpy_htod_sync(h.word(slot, DONE), &[nonce]);
                }
                return Err("a full round did not finish within 5 s".into());
            }
            std::thread::yield_now();
        }
        ok?;
        cubecl::future::block_on(client.sync()).map_err(err)?;
        Ok(h)
    }

    fn word(&self, slot: usize, offset: usize) -> u64 {
        self.base + ((slot * SLOT_WORDS + offset) * size_of::<u32>()) as u64
    }

    /// Launch the CubeCL half (issued at once: this runs on CubeCL's device thread).
    fn launch_cubecl_half(&self, client: &ComputeClient<CudaRuntime>, slot: usize, nonce: u32) {
        // SAFETY: the ring holds SLOTS × SLOT_WORDS u32 words.
        let flags = unsafe { ArrayArg::from_raw_parts(self.ring.clone(), SLOTS * SLOT_WORDS) };
        launch_handshake(client, flags, slot as u32, nonce);
    }

    /// One handshake around `work`.
    fn round(&mut self, client: &ComputeClient<CudaRuntime>, stream: dsys::CUstream, work: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
        let (slot, nonce) = self.next()?;
        self.launch_cubecl_half(client, slot, nonce);
        let result = SyncKernels::launch(self.kernels.wait_ready, stream, self.word(slot, READY), nonce).and_then(|()| work());
        // *done* is written whatever failed: CubeCL's stream must never be left spinning.
        SyncKernels::launch(self.kernels.signal_done, stream, self.word(slot, DONE), nonce)?;
        self.record(slot, stream)?;
        result
    }

    /// The next `(slot, nonce)`, after the slot's previous handshake has completed.
    fn next(&mut self) -> Result<(usize, u32), String> {
        self.nonce = self.nonce.wrapping_add(1).max(1);
        let slot = self.nonce as usize % SLOTS;
        if let Some(event) = self.pending[slot] {
            // SAFETY: a live event of this ring; returns at once when it has completed.
            unsafe { drv::event::synchronize(event) }.map_err(err)?;
        }
        Ok((slot, self.nonce))
    }

    /// Mark `slot` busy until the work enqueued so far on `stream` has completed.
    fn record(&mut self, slot: usize, stream: dsys::CUstream) -> Result<(), String> {
        let event = match self.pending[slot] {
            Some(e) => e,
            None => drv::event::create(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(err)?,
        };
        self.pending[slot] = Some(event);
        // SAFETY: live event and stream.
        unsafe { drv::event::record(event, stream) }.map_err(err)
    }
}
