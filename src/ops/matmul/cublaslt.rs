//! cuBLASLt on the device memory of CubeCL tensors (CUDA only).
//!
//! cuBLASLt is loaded at run time through `cudarc` (the crate cubecl-cuda already uses for the
//! driver), so a machine without it still runs: [`Engine::get`] answers `None` and the caller
//! falls back to Burn's matmul.
//!
//! Ordering against CubeCL: CubeCL 0.10 keeps its `CUstream` private, so kiln owns one stream
//! per device for cuBLASLt and orders it against CubeCL's stream with one of two strategies
//! ([`StreamOrder`]), measured side by side in the GPU check:
//! - [`StreamOrder::DeviceHandshake`] (default): the device-memory handshake of
//!   `kiln_kernels::stream_handshake`; nothing waits on the host (except, as back-pressure, when
//!   [`SLOTS`] handshakes are still pending).
//! - [`StreamOrder::HostSync`]: wait on the host for CubeCL's stream to drain, run the GEMM,
//!   wait for it. Always correct, costs two host round trips per product.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use burn::tensor::DType;
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::{ArrayArg, ComputeClient};
use cubecl::server::Handle;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{result as drv, sys as dsys};
use kiln_kernels::stream_handshake::{DONE, READY, SLOT_WORDS, launch_handshake};

use super::GemmLayout;

/// How the cuBLASLt stream is ordered against CubeCL's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamOrder {
    /// Device-side wait on flags written by a one-unit CubeCL kernel (no host synchronization).
    DeviceHandshake,
    /// Host waits for CubeCL's stream before the GEMM and for the GEMM after it.
    HostSync,
    /// No ordering at all: wrong results whenever a producer or consumer overlaps the product.
    /// Exists only as the negative control of the GPU check's ordering test
    /// (`KILN_GEMM_ORDER=unordered`), which must fail with it.
    Unordered,
}

/// The strategy in use: `KILN_GEMM_ORDER=sync` forces [`StreamOrder::HostSync`]; otherwise the
/// handshake wherever its two helper kernels compiled.
fn stream_order(kernels: &Option<SyncKernels>) -> StreamOrder {
    match std::env::var("KILN_GEMM_ORDER").unwrap_or_default().as_str() {
        "unordered" => StreamOrder::Unordered,
        "sync" => StreamOrder::HostSync,
        _ if kernels.is_some() => StreamOrder::DeviceHandshake,
        _ => StreamOrder::HostSync,
    }
}

/// kiln's half of the handshake: two one-thread kernels on kiln's stream. (The driver's
/// `cuStreamWaitValue32`/`cuStreamWriteValue32` would do without kernels, but on the H100 with
/// driver 580 they answered `CUDA_ERROR_INVALID_VALUE` for the flag buffer CubeCL allocates, from
/// its stream-ordered pool, while accepting `cuMemAlloc` memory; CubeCL kernels can only bind
/// CubeCL's memory.)
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
        let ptx = cudarc::nvrtc::compile_ptx(SYNC_KERNELS).map_err(|e| format!("{e:?}"))?;
        let image = std::ffi::CString::new(ptx.to_src()).map_err(|e| format!("{e:?}"))?;
        // SAFETY: a NUL-terminated PTX image; the module stays loaded for the process.
        unsafe {
            let module = drv::module::load_data(image.as_ptr() as *const c_void).map_err(|e| format!("{e:?}"))?;
            let function = |name: &str| {
                drv::module::get_function(module, std::ffi::CString::new(name).expect("no NUL")).map_err(|e| format!("{e:?}"))
            };
            Ok(Self { wait_ready: function("kiln_wait_ready")?, signal_done: function("kiln_signal_done")? })
        }
    }

    /// Run both kernels once with nothing else in flight. CUDA loads kernels lazily, and loading
    /// one may synchronize the whole context: were that to happen inside a handshake, while the
    /// CubeCL half spins, the host would wait on a kernel that waits on the host.
    fn warm_up(self, stream: dsys::CUstream, scratch: dsys::CUdeviceptr) -> Result<Self, String> {
        Self::launch(self.signal_done, stream, scratch, 1)?;
        Self::launch(self.wait_ready, stream, scratch, 1)?;
        // SAFETY: kiln's live stream.
        unsafe { drv::stream::synchronize(stream) }.map_err(|e| format!("{e:?}"))?;
        Ok(self)
    }

    /// Launch `f(flag, nonce)` on one thread of `stream`.
    fn launch(f: dsys::CUfunction, stream: dsys::CUstream, flag: u64, nonce: u32) -> Result<(), String> {
        let (mut flag, mut nonce) = (flag, nonce);
        let mut params = [&mut flag as *mut u64 as *mut c_void, &mut nonce as *mut u32 as *mut c_void];
        // SAFETY: `f` takes (unsigned int*, unsigned int); the parameters outlive the call.
        unsafe { drv::launch_kernel(f, (1, 1, 1), (1, 1, 1), 0, stream, &mut params) }.map_err(|e| format!("{e:?}"))
    }
}

/// One matrix operand as cuBLASLt sees it: a column-major view of row-major storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Operand {
    /// Row-major rows and columns of one stored matrix.
    rows: usize,
    cols: usize,
    /// Elements between consecutive rows (≥ cols).
    row_stride: usize,
    /// Elements between consecutive matrices of the batch (0 broadcasts one matrix).
    batch_stride: usize,
}

impl Operand {
    /// Reads a rank-3 tensor whose last axis is unit-stride.
    fn of<R: CubeRuntime>(t: &CubeTensor<R>) -> Self {
        let (shape, strides) = (t.meta.shape(), t.meta.strides());
        let batch_stride = if shape[0] == 1 { 0 } else { strides[0] };
        Self { rows: shape[1], cols: shape[2], row_stride: strides[1], batch_stride }
    }
}

/// Everything a cached cuBLASLt plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    dtype: DType,
    layout: GemmLayout,
    batch: usize,
    lhs: Operand,
    rhs: Operand,
    out: Operand,
    bias: bool,
    residual: bool,
    /// Largest power-of-two alignment (≤ 256 bytes) of every pointer; algorithms are chosen for it.
    alignment: u32,
}

/// Descriptors and the heuristic's algorithm for one [`PlanKey`] (handles: copied freely, owned
/// and destroyed by [`Plan`]).
#[derive(Clone, Copy)]
struct PlanParts {
    desc: sys::cublasLtMatmulDesc_t,
    /// cuBLASLt's A, B, C and D layouts (A = the rhs tensor, B = the lhs tensor: see [`build_plan`]).
    layouts: [sys::cublasLtMatrixLayout_t; 4],
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: usize,
}

/// The owner of one cached [`PlanParts`].
struct Plan(PlanParts);

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created for this plan and is destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.0.desc);
            for layout in self.0.layouts {
                let _ = lt::destroy_matrix_layout(layout);
            }
        }
    }
}

/// Per-device cuBLASLt state: handle, kiln's stream, workspace and the plan cache.
pub(crate) struct Engine {
    context: dsys::CUcontext,
    handle: sys::cublasLtHandle_t,
    stream: dsys::CUstream,
    workspace: dsys::CUdeviceptr,
    workspace_size: usize,
    order: StreamOrder,
    plans: HashMap<PlanKey, Plan>,
    /// The handshake's flag slots, created on first use and kept for the process's lifetime.
    ring: Option<Ring>,
    kernels: Option<SyncKernels>,
}

/// Handshake slots in flight at once before the host waits for the oldest.
pub const SLOTS: usize = 256;

/// The persistent flag buffer of the device handshake and the bookkeeping that keeps each slot's
/// handshakes from overlapping.
struct Ring {
    /// Keeps CubeCL from ever reusing the buffer for other data.
    handle: Handle,
    base: u64,
    /// The last nonce handed out (never 0, so a fresh zeroed word matches no handshake).
    nonce: u32,
    /// Per slot, an event recorded after its last handshake's *done* write.
    pending: Vec<Option<dsys::CUevent>>,
}

impl Ring {
    /// The ring, after one handshake of each half has been seen to work on this device: slot 0
    /// runs the CubeCL half alone (its *done* word preset), slot 1 a full round with kiln's
    /// kernels. A failure (an error CubeCL recorded for the launch, a flag not written, a round
    /// not done within seconds) is an `Err`, and products then use host synchronization.
    fn new(client: &ComputeClient<CudaRuntime>, kernels: &SyncKernels, stream: dsys::CUstream) -> Result<Self, String> {
        const PROBE: u32 = u32::MAX;
        let mut words = vec![0u32; SLOTS * SLOT_WORDS];
        words[DONE] = PROBE;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let handle = client.create_from_slice(&bytes);
        let base = client.get_resource(handle.clone()).map_err(|e| format!("{e:?}"))?.resource().ptr;
        let ring = Self { handle, base, nonce: 1, pending: vec![None; SLOTS] };
        // SAFETY (both launches): the buffer holds SLOTS × SLOT_WORDS u32 words.
        launch_handshake(client, unsafe { ArrayArg::from_raw_parts(ring.handle.clone(), SLOTS * SLOT_WORDS) }, 0, PROBE);
        client.flush().map_err(|e| format!("CubeCL half: {e:?}"))?;
        let read = client.read_one(ring.handle.clone()).map_err(|e| format!("{e:?}"))?;
        if read[..4] != PROBE.to_le_bytes() {
            return Err("the CubeCL half did not signal ready".into());
        }
        launch_handshake(client, unsafe { ArrayArg::from_raw_parts(ring.handle.clone(), SLOTS * SLOT_WORDS) }, 1, 1);
        SyncKernels::launch(kernels.wait_ready, stream, ring.word(1, READY), 1)?;
        SyncKernels::launch(kernels.signal_done, stream, ring.word(1, DONE), 1)?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        // SAFETY (all calls): kiln's live stream; the ring's words are live device memory.
        while unsafe { dsys::cuStreamQuery(stream) } == dsys::CUresult::CUDA_ERROR_NOT_READY {
            if std::time::Instant::now() > deadline {
                // Release both spinning kernels before giving up on the handshake.
                unsafe {
                    let _ = drv::memcpy_htod_sync(ring.word(1, READY), &[1u32]);
                    let _ = drv::memcpy_htod_sync(ring.word(1, DONE), &[1u32]);
                }
                return Err("a full handshake round did not finish within 5 s".into());
            }
            std::thread::yield_now();
        }
        cubecl::future::block_on(client.sync()).map_err(|e| format!("{e:?}"))?;
        Ok(ring)
    }

    /// The next `(slot, nonce)`, after the slot's previous handshake has completed.
    fn next(&mut self) -> Result<(usize, u32), String> {
        self.nonce = self.nonce.wrapping_add(1).max(1);
        let slot = self.nonce as usize % SLOTS;
        if let Some(event) = self.pending[slot] {
            // SAFETY: a live event of this ring; returns at once when it has completed.
            unsafe { drv::event::synchronize(event) }.map_err(|e| format!("{e:?}"))?;
        }
        Ok((slot, self.nonce))
    }

    fn word(&self, slot: usize, offset: usize) -> u64 {
        self.base + ((slot * SLOT_WORDS + offset) * size_of::<u32>()) as u64
    }

    /// Mark `slot` busy until the work enqueued so far on `stream` has completed.
    fn record(&mut self, slot: usize, stream: dsys::CUstream) -> Result<(), String> {
        let event = match self.pending[slot] {
            Some(e) => e,
            None => drv::event::create(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| format!("{e:?}"))?,
        };
        self.pending[slot] = Some(event);
        // SAFETY: live event and stream.
        unsafe { drv::event::record(event, stream) }.map_err(|e| format!("{e:?}"))
    }
}

// SAFETY: the raw CUDA handles are only used while holding the engine's mutex, with the device's
// primary context made current first.
unsafe impl Send for Engine {}

type Engines = Mutex<HashMap<usize, Option<Engine>>>;

fn engines() -> &'static Engines {
    static ENGINES: OnceLock<Engines> = OnceLock::new();
    ENGINES.get_or_init(Default::default)
}

impl Engine {
    /// Run `f` with the engine of CUDA device `index`, created on first use; `None` when cuBLASLt
    /// cannot be loaded or set up there (the caller then uses Burn's matmul).
    pub(crate) fn with<T>(index: usize, f: impl FnOnce(&mut Engine) -> T) -> Option<T> {
        let mut engines = engines().lock().unwrap_or_else(|e| e.into_inner());
        let engine = engines.entry(index).or_insert_with(|| Engine::new(index).ok()).as_mut()?;
        // SAFETY: the primary context outlives the process's use of the device.
        unsafe { drv::ctx::set_current(engine.context) }.ok()?;
        Some(f(engine))
    }

    fn new(index: usize) -> Result<Self, String> {
        // SAFETY: probing for the shared library has no preconditions.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcublasLt not found".into());
        }
        let err = |e: &dyn std::fmt::Debug| format!("{e:?}");
        drv::init().map_err(|e| err(&e))?;
        let device = drv::device::get(index as i32).map_err(|e| err(&e))?;
        // SAFETY: `device` is valid; the primary context is the one cubecl-cuda retains, so
        // CubeCL's device pointers are valid in it.
        let context = unsafe { drv::primary_ctx::retain(device) }.map_err(|e| err(&e))?;
        unsafe { drv::ctx::set_current(context) }.map_err(|e| err(&e))?;
        let major = unsafe {
            drv::device::get_attribute(device, dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        }
        .map_err(|e| err(&e))?;
        // NVIDIA's recommendation: 32 MiB of workspace on Hopper, 4 MiB before.
        let workspace_size = if major >= 9 { 32 << 20 } else { 4 << 20 };
        let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).map_err(|e| err(&e))?;
        let workspace = unsafe { drv::malloc_sync(workspace_size) }.map_err(|e| err(&e))?;
        let handle = lt::create_handle().map_err(|e| err(&e))?;
        let kernels = SyncKernels::new().and_then(|k| k.warm_up(stream, workspace)).ok();
        let order = stream_order(&kernels);
        Ok(Self { context, handle, stream, workspace, workspace_size, order, plans: HashMap::new(), ring: None, kernels })
    }

    /// Create the handshake's ring on first use; if the handshake fails its self-test here, say
    /// so once and use host synchronization from now on.
    fn set_up_handshake(&mut self, client: &ComputeClient<CudaRuntime>) {
        let Some(kernels) = &self.kernels else { return };
        match Ring::new(client, kernels, self.stream) {
            Ok(ring) => self.ring = Some(ring),
            Err(e) => {
                eprintln!("kiln::matmul: the cuBLASLt stream handshake failed its self-test ({e}); using host synchronization");
                self.order = StreamOrder::HostSync;
            }
        }
    }

    fn plan(&mut self, key: PlanKey) -> Result<PlanParts, String> {
        if !self.plans.contains_key(&key) {
            let plan = build_plan(self.handle, &key, self.workspace_size)?;
            self.plans.insert(key, Plan(plan));
        }
        Ok(self.plans[&key].0)
    }
}

/// The ordering strategy of cuBLASLt products on CUDA device `index`; `None` where cuBLASLt cannot
/// be loaded (products then run through Burn's matmul).
pub fn cublaslt_stream_order(index: usize) -> Option<StreamOrder> {
    Engine::with(index, |engine| engine.order)
}

fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

/// f32 products run on the tensor cores in TF32 (as PyTorch's `allow_tf32` / Burn's own CUDA
/// matmul do) unless `KILN_GEMM_TF32=0`; f16/bf16 accumulate in f32.
fn compute_type(dtype: DType) -> sys::cublasComputeType_t {
    let tf32 = !std::env::var("KILN_GEMM_TF32").is_ok_and(|v| v == "0");
    match dtype {
        DType::F32 if tf32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    }
}

fn layout(dtype: sys::cudaDataType, op: &Operand, batch: usize) -> Result<sys::cublasLtMatrixLayout_t, String> {
    // Row-major [rows, cols] with row stride `ld` is column-major [cols, rows] with the same ld.
    let l = lt::create_matrix_layout(dtype, op.cols as u64, op.rows as u64, op.row_stride as i64)
        .map_err(|e| format!("{e:?}"))?;
    let count = batch as i32;
    let offset = op.batch_stride as i64;
    // SAFETY: `l` is a live layout; the buffers are plain values of the documented types.
    unsafe {
        set(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count)?;
        set(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset)?;
    }
    Ok(l)
}

unsafe fn set<T>(l: sys::cublasLtMatrixLayout_t, attr: sys::cublasLtMatrixLayoutAttribute_t, v: &T) -> Result<(), String> {
    unsafe { lt::set_matrix_layout_attribute(l, attr, v as *const T as *const c_void, size_of::<T>()) }
        .map_err(|e| format!("{e:?}"))
}

unsafe fn set_desc<T>(d: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<(), String> {
    unsafe { lt::set_matmul_desc_attribute(d, attr, v as *const T as *const c_void, size_of::<T>()) }
        .map_err(|e| format!("{e:?}"))
}

unsafe fn set_pref<T>(
    p: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<(), String> {
    unsafe { lt::set_matmul_pref_attribute(p, attr, v as *const T as *const c_void, size_of::<T>()) }
        .map_err(|e| format!("{e:?}"))
}

/// Descriptors for `key` and cuBLASLt's heuristic pick among algorithms that fit the workspace
/// and the pointers' alignment.
fn build_plan(handle: sys::cublasLtHandle_t, key: &PlanKey, workspace_size: usize) -> Result<PlanParts, String> {
    use sys::cublasLtMatmulDescAttributes_t as D;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let dt = data_type(key.dtype).ok_or("unsupported dtype")?;
    let desc = lt::create_matmul_desc(compute_type(key.dtype), sys::cudaDataType::CUDA_R_32F).map_err(|e| format!("{e:?}"))?;
    // cublasOperation_t (defined in cuBLAS proper, not cuBLASLt): CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
    let op = |t: bool| i32::from(t);
    let epilogue = if key.bias { sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS } else { sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT };
    // SAFETY: live descriptors, attribute values of the documented types.
    unsafe {
        // Column-major outᵀ = op(rhs)ᵀ · op(lhs)ᵀ: cuBLASLt's A is the rhs tensor, its B the lhs.
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(key.layout.transpose_rhs))?;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(key.layout.transpose_lhs))?;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
    }
    let layouts = [
        layout(dt, &key.rhs, key.batch)?,
        layout(dt, &key.lhs, key.batch)?,
        layout(dt, &key.out, key.batch)?,
        layout(dt, &key.out, key.batch)?,
    ];
    let pref = lt::create_matmul_pref().map_err(|e| format!("{e:?}"))?;
    let heuristic = unsafe {
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &(workspace_size as u64))?;
        for attr in [
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ] {
            set_pref(pref, attr, &key.alignment)?;
        }
        let h = lt::get_matmul_algo_heuristic(handle, desc, layouts[0], layouts[1], layouts[2], layouts[3], pref);
        let _ = lt::destroy_matmul_pref(pref);
        h.map_err(|e| format!("no cuBLASLt algorithm for {key:?}: {e:?}"))?
    };
    Ok(PlanParts { desc, layouts, algo: heuristic.algo, workspace: heuristic.workspaceSize })
}

/// The device pointer of a tensor's first element, taken through CubeCL (which also orders the
/// handle's producer against CubeCL's current stream).
fn pointer(client: &ComputeClient<CudaRuntime>, t: &CubeTensor<impl CubeRuntime>) -> Result<u64, String> {
    let resource = client.get_resource(t.handle.clone()).map_err(|e| format!("{e:?}"))?;
    Ok(resource.resource().ptr)
}

fn alignment(ptrs: &[u64], elem: usize, op: &[Operand]) -> u32 {
    let strides = op.iter().flat_map(|o| [o.row_stride, o.batch_stride]).map(|s| (s * elem) as u64);
    let all = ptrs.iter().copied().chain(strides).fold(0u64, |acc, v| acc | v);
    if all == 0 { 256 } else { (1u64 << all.trailing_zeros()).min(256) as u32 }
}

/// The operands of one product, all rank 3 (`[batch, rows, cols]`, unit stride on the last
/// axis); `out` is a fresh dense tensor.
pub(crate) struct GemmArgs<'a, R: CubeRuntime> {
    pub lhs: &'a CubeTensor<R>,
    pub rhs: &'a CubeTensor<R>,
    pub bias: Option<&'a CubeTensor<R>>,
    pub residual: Option<&'a CubeTensor<R>>,
    pub out: &'a CubeTensor<R>,
    pub layout: GemmLayout,
}

/// `out = op(lhs) · op(rhs) + bias + residual` through cuBLASLt, ordered against CubeCL's stream.
/// `Ok(false)` when this runtime, dtype or layout is not served (nothing was enqueued: the caller
/// uses Burn's matmul); `Err` when cuBLASLt failed after work was enqueued.
pub(crate) fn gemm<R: CubeRuntime>(args: &GemmArgs<'_, R>, device_index: usize) -> Result<bool, String> {
    let Some(client) = (&args.out.client as &dyn std::any::Any).downcast_ref::<ComputeClient<CudaRuntime>>() else {
        return Ok(false);
    };
    if data_type(args.out.dtype).is_none() {
        return Ok(false);
    }
    Engine::with(device_index, |engine| run(engine, client, args)).unwrap_or(Ok(false))
}

fn run<R: CubeRuntime>(engine: &mut Engine, client: &ComputeClient<CudaRuntime>, a: &GemmArgs<'_, R>) -> Result<bool, String> {
    let (lhs, rhs, out) = (Operand::of(a.lhs), Operand::of(a.rhs), Operand::of(a.out));
    let residual_op = a.residual.map(Operand::of);
    if residual_op.is_some_and(|r| r != out) {
        return Ok(false);
    }
    let ptr = |t: &CubeTensor<R>| pointer(client, t);
    let (p_lhs, p_rhs, p_out) = (ptr(a.lhs)?, ptr(a.rhs)?, ptr(a.out)?);
    let p_bias = a.bias.map(ptr).transpose()?;
    let p_residual = a.residual.map(ptr).transpose()?;
    let pointers: Vec<u64> = [Some(p_lhs), Some(p_rhs), Some(p_out), p_bias, p_residual].into_iter().flatten().collect();
    let key = PlanKey {
        dtype: a.out.dtype,
        layout: a.layout,
        batch: a.out.meta.shape()[0],
        lhs,
        rhs,
        out,
        bias: a.bias.is_some(),
        residual: a.residual.is_some(),
        alignment: alignment(&pointers, a.out.dtype.size(), &[lhs, rhs, out]),
    };
    let (handle, stream, workspace) = (engine.handle, engine.stream, engine.workspace);
    // A plan's first product runs under host sync: it loads cuBLASLt's kernel, which (see
    // `SyncKernels::warm_up`) must not happen inside a handshake.
    let first_use = !engine.plans.contains_key(&key);
    if engine.order == StreamOrder::DeviceHandshake && engine.ring.is_none() {
        engine.set_up_handshake(client);
    }
    let order = if first_use && engine.order == StreamOrder::DeviceHandshake { StreamOrder::HostSync } else { engine.order };
    let Ok(plan) = engine.plan(key) else { return Ok(false) };
    if let Some(bias) = p_bias {
        // SAFETY: live descriptor; the plan is used under the engine's lock only.
        unsafe { set_desc(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)? };
    }
    let (alpha, beta) = (1f32, if a.residual.is_some() { 1f32 } else { 0f32 });
    let c = p_residual.unwrap_or(p_out);
    let launch = || unsafe {
        // SAFETY: every pointer is a live CubeCL allocation of the shape its layout describes, kept
        // alive (and unreused) until CubeCL's stream passes the point ordered after this launch.
        lt::matmul(
            handle,
            plan.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            p_rhs as *const c_void,
            plan.layouts[0],
            p_lhs as *const c_void,
            plan.layouts[1],
            c as *const c_void,
            plan.layouts[2],
            p_out as *mut c_void,
            plan.layouts[3],
            &plan.algo,
            workspace as *mut c_void,
            plan.workspace,
            stream as sys::cudaStream_t,
        )
        .map_err(|e| format!("cublasLtMatmul: {e:?}"))
    };
    let outcome = match order {
        StreamOrder::Unordered => launch(),
        StreamOrder::HostSync => {
            cubecl::future::block_on(client.sync()).map_err(|e| format!("{e:?}"))?;
            let result = launch();
            // SAFETY: kiln's own live stream.
            unsafe { drv::stream::synchronize(stream) }.map_err(|e| format!("{e:?}"))?;
            result
        }
        StreamOrder::DeviceHandshake => {
            let kernels = engine.kernels.as_ref().expect("the handshake is only chosen with its kernels");
            let ring = engine.ring.as_mut().expect("set up on the plan's first (host-synchronized) use");
            let (slot, nonce) = ring.next()?;
            // SAFETY: the ring's buffer holds SLOTS × SLOT_WORDS u32 words.
            let flags = unsafe { ArrayArg::from_raw_parts(ring.handle.clone(), SLOTS * SLOT_WORDS) };
            launch_handshake(client, flags, slot as u32, nonce);
            SyncKernels::launch(kernels.wait_ready, stream, ring.word(slot, READY), nonce)?;
            let result = launch();
            // DONE is signalled even when the product failed: the CubeCL stream must never be left
            // spinning.
            SyncKernels::launch(kernels.signal_done, stream, ring.word(slot, DONE), nonce)?;
            ring.record(slot, stream)?;
            result
        }
    };
    outcome.map(|()| true)
}
