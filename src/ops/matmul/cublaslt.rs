//! cuBLASLt on the device memory of CubeCL tensors (CUDA only).
//!
//! cuBLASLt is loaded at run time through `cudarc` (the crate cubecl-cuda already uses for the
//! driver), so a machine without it still runs: [`Engine::with`] answers `None` and the caller
//! falls back to Burn's matmul.
//!
//! Products run on CubeCL's own stream where it can be learned, else on a stream of kiln's
//! ordered against CubeCL's (`stream_order.rs`). Each product runs on CubeCL's device thread
//! (`ComputeClient::exclusive`): CubeCL's calls inside it (device pointers, launches) then run at
//! once instead of each waiting for that thread, and CubeCL's earlier launches have been issued.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{result as drv, sys as dsys};

use super::GemmLayout;
use super::stream_order::{Lane, Ordering, StreamOrder};
use super::tuning::{GATED_FLOPS, tune};
use crate::backend::cube::empty_like_device;

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
    /// Reads a rank-3 tensor whose last axis is unit-stride. A single row's stride is never used,
    /// so it is taken as `cols` (views such as `[b, 1, k]` after a transpose can carry any
    /// stride there, which cuBLASLt would reject as a leading dimension below `cols`).
    fn of<R: CubeRuntime>(t: &CubeTensor<R>) -> Self {
        let (shape, strides) = (t.meta.shape(), t.meta.strides());
        let batch_stride = if shape[0] == 1 { 0 } else { strides[0] };
        let row_stride = if shape[1] == 1 { shape[2] } else { strides[1] };
        Self { rows: shape[1], cols: shape[2], row_stride, batch_stride }
    }
}

/// Everything a cached cuBLASLt plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    /// The operands' dtype (`I8`: i8 inputs, i32 output and accumulation).
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

impl PlanKey {
    /// Multiply-adds × 2 of the product.
    fn flops(&self) -> f64 {
        let k = if self.layout.transpose_lhs { self.lhs.rows } else { self.lhs.cols };
        2.0 * (self.batch * self.out.rows * self.out.cols) as f64 * k as f64
    }
}

/// One algorithm cuBLASLt's heuristic offered, with the workspace it needs.
#[derive(Clone, Copy)]
struct Algo {
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: usize,
}

/// Descriptors and the chosen algorithm for one [`PlanKey`] (handles: copied freely, owned and
/// destroyed by [`Plan`]).
#[derive(Clone, Copy)]
struct PlanParts {
    desc: sys::cublasLtMatmulDesc_t,
    /// cuBLASLt's A and B layouts (A = the rhs tensor, B = the lhs tensor: see [`build_plan`]),
    /// then the output's, which serves as both C (the residual) and D.
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: Algo,
}

/// The owner of one cached [`PlanParts`], with the heuristic's candidates until the first product
/// has timed them (see [`tune`]).
struct Plan {
    parts: PlanParts,
    candidates: Vec<Algo>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        destroy(self.parts.desc, &self.parts.layouts);
    }
}

/// Destroy a plan's descriptors (each created once, destroyed once).
fn destroy(desc: sys::cublasLtMatmulDesc_t, layouts: &[sys::cublasLtMatrixLayout_t]) {
    // SAFETY: live descriptors owned by the caller, not used afterwards.
    unsafe {
        let _ = lt::destroy_matmul_desc(desc);
        for &layout in layouts {
            let _ = lt::destroy_matrix_layout(layout);
        }
    }
}

/// Per-device cuBLASLt state: handle, stream ordering (with the streams and workspaces) and the
/// plan cache.
pub(crate) struct Engine {
    context: dsys::CUcontext,
    handle: sys::cublasLtHandle_t,
    /// Bytes of each lane's workspace.
    workspace_size: usize,
    /// SMs cuBLASLt should plan for: one less than the device has while the handshake's CubeCL
    /// kernel spins on one of them during every product (H100, 8192×4096×4096 bf16: 400 µs
    /// against 455 µs planning for all; `KILN_GEMM_SM_TARGET=all` restores that, for measurements).
    sm_target: Option<i32>,
    ordering: Ordering,
    plans: HashMap<PlanKey, Plan>,
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
    /// Run `f` with the engine of CUDA device `index` (`client`'s device), created on first use;
    /// `None` when cuBLASLt cannot be loaded or set up there (the caller then uses Burn's matmul).
    /// Runs on CubeCL's device thread, which also keeps one lock order (that thread, then the
    /// engines' lock) whichever thread asks.
    fn with<T: Send + 'static>(
        client: &ComputeClient<CudaRuntime>,
        index: usize,
        f: impl FnOnce(&mut Engine) -> T + Send,
    ) -> Option<T> {
        client
            .exclusive(|| {
                let mut engines = engines().lock().unwrap_or_else(|e| e.into_inner());
                let engine = engines.entry(index).or_insert_with(|| Engine::new(index, client).ok()).as_mut()?;
                // SAFETY: the primary context outlives the process's use of the device.
                unsafe { drv::ctx::set_current(engine.context) }.ok()?;
                Some(f(engine))
            })
            .ok()
            .flatten()
    }

    fn new(index: usize, client: &ComputeClient<CudaRuntime>) -> Result<Self, String> {
        // SAFETY: probing for the shared library has no preconditions.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcublasLt not found".into());
        }
        drv::init().map_err(err)?;
        let device = drv::device::get(index as i32).map_err(err)?;
        // SAFETY: `device` is valid; the primary context is the one cubecl-cuda retains, so
        // CubeCL's device pointers are valid in it.
        let context = unsafe { drv::primary_ctx::retain(device) }.map_err(err)?;
        unsafe { drv::ctx::set_current(context) }.map_err(err)?;
        let major = unsafe {
            drv::device::get_attribute(device, dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        }
        .map_err(err)?;
        // NVIDIA's recommendation: 32 MiB of workspace on Hopper, 4 MiB before.
        let workspace_size = if major >= 9 { 32 << 20 } else { 4 << 20 };
        let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).map_err(err)?;
        let workspace = unsafe { drv::malloc_sync(workspace_size) }.map_err(err)?;
        let handle = lt::create_handle().map_err(err)?;
        let ordering = Ordering::new(client, Lane { stream, workspace }, workspace_size);
        let sms = unsafe { drv::device::get_attribute(device, dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) }
            .map_err(err)?;
        let margin = ordering.order() == StreamOrder::DeviceHandshake && std::env::var("KILN_GEMM_SM_TARGET").as_deref() != Ok("all");
        let sm_target = margin.then_some(sms - 1);
        Ok(Self { context, handle, workspace_size, sm_target, ordering, plans: HashMap::new() })
    }

    /// The plan for `key` and, on its first use, the candidate algorithms still to be timed.
    fn plan(&mut self, key: PlanKey) -> Result<(PlanParts, Vec<Algo>), String> {
        if !self.plans.contains_key(&key) {
            let plan = build_plan(self.handle, &key, self.workspace_size, self.sm_target)?;
            self.plans.insert(key, plan);
        }
        let plan = self.plans.get_mut(&key).expect("inserted above");
        Ok((plan.parts, std::mem::take(&mut plan.candidates)))
    }
}

/// The ordering strategy of cuBLASLt products on CUDA device `index`; `None` where cuBLASLt cannot
/// be loaded (products then run through Burn's matmul).
pub fn cublaslt_stream_order(index: usize) -> Option<StreamOrder> {
    on_device(index, |engine| engine.ordering.order())
}

/// [`Engine::with`] for a CUDA device index (the public entry points that get no tensor).
fn on_device<T: Send + 'static>(index: usize, f: impl FnOnce(&mut Engine) -> T + Send) -> Option<T> {
    use cubecl::Runtime;
    Engine::with(&CudaRuntime::client(&cubecl::cuda::CudaDevice::new(index)), index, f)
}

/// A driver or library error as text (the errors here end as `Err(String)` or a panic message).
pub(super) fn err(e: impl std::fmt::Debug) -> String {
    format!("{e:?}")
}

fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        DType::I8 => Some(sys::cudaDataType::CUDA_R_8I),
        _ => None,
    }
}

/// The output's dtype for operands of `dtype`: the same for floats, i32 for i8.
fn out_dtype(dtype: DType) -> DType {
    if dtype == DType::I8 { DType::I32 } else { dtype }
}

/// The type of alpha and beta: i32 for integer products, else f32.
fn scale_type(dtype: DType) -> sys::cudaDataType {
    if dtype == DType::I8 { sys::cudaDataType::CUDA_R_32I } else { sys::cudaDataType::CUDA_R_32F }
}

/// f32 products run on the tensor cores in TF32 (as PyTorch's `allow_tf32` / Burn's own CUDA
/// matmul do) unless `KILN_GEMM_TF32=0`; f16/bf16 accumulate in f32.
fn compute_type(dtype: DType) -> sys::cublasComputeType_t {
    let tf32 = !std::env::var("KILN_GEMM_TF32").is_ok_and(|v| v == "0");
    match dtype {
        DType::F32 if tf32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        DType::I8 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32I,
        _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    }
}

fn layout(dtype: sys::cudaDataType, op: &Operand, batch: usize) -> Result<sys::cublasLtMatrixLayout_t, String> {
    // Row-major [rows, cols] with row stride `ld` is column-major [cols, rows] with the same ld.
    let l = lt::create_matrix_layout(dtype, op.cols as u64, op.rows as u64, op.row_stride as i64)
        .map_err(err)?;
    let count = batch as i32;
    let offset = op.batch_stride as i64;
    // SAFETY: `l` is a live layout; the buffers are plain values of the documented types.
    let attributes = unsafe {
        set(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count)
            .and_then(|()| set(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset))
    };
    if attributes.is_err() {
        // SAFETY: `l` was created above and is not returned.
        let _ = unsafe { lt::destroy_matrix_layout(l) };
    }
    attributes.map(|()| l)
}

unsafe fn set<T>(l: sys::cublasLtMatrixLayout_t, attr: sys::cublasLtMatrixLayoutAttribute_t, v: &T) -> Result<(), String> {
    unsafe { lt::set_matrix_layout_attribute(l, attr, v as *const T as *const c_void, size_of::<T>()) }
        .map_err(err)
}

unsafe fn set_desc<T>(d: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<(), String> {
    unsafe { lt::set_matmul_desc_attribute(d, attr, v as *const T as *const c_void, size_of::<T>()) }
        .map_err(err)
}

unsafe fn set_pref<T>(
    p: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<(), String> {
    unsafe { lt::set_matmul_pref_attribute(p, attr, v as *const T as *const c_void, size_of::<T>()) }
        .map_err(err)
}

/// Algorithms asked of cuBLASLt's heuristic per plan; the first product times them all.
/// `KILN_GEMM_CANDIDATES` (1–64) overrides, for measurements.
fn candidates() -> usize {
    kiln_kernels::measurement_override("KILN_GEMM_CANDIDATES", 1..=64).unwrap_or(8)
}

/// Descriptors for `key` and cuBLASLt's heuristic candidates among algorithms that fit the
/// workspace and the pointers' alignment (its first pick chosen until [`tune`] has run).
fn build_plan(handle: sys::cublasLtHandle_t, key: &PlanKey, workspace_size: usize, sm_target: Option<i32>) -> Result<Plan, String> {
    use sys::cublasLtMatmulDescAttributes_t as D;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let dt = data_type(key.dtype).ok_or("unsupported dtype")?;
    let dt_out = data_type(out_dtype(key.dtype)).unwrap_or(sys::cudaDataType::CUDA_R_32I);
    let desc = lt::create_matmul_desc(compute_type(key.dtype), scale_type(key.dtype)).map_err(err)?;
    // cublasOperation_t (defined in cuBLAS proper, not cuBLASLt): CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
    let op = |t: bool| i32::from(t);
    let epilogue = if key.bias { sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS } else { sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT };
    let mut layouts = Vec::with_capacity(3);
    let heuristic = (|| {
        // SAFETY: live descriptors, attribute values of the documented types.
        unsafe {
            // Column-major outᵀ = op(rhs)ᵀ · op(lhs)ᵀ: cuBLASLt's A is the rhs tensor, its B the lhs.
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(key.layout.transpose_rhs))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(key.layout.transpose_lhs))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
            if let Some(sms) = sm_target {
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms)?;
            }
        }
        for (operand, dt) in [(&key.rhs, dt), (&key.lhs, dt), (&key.out, dt_out)] {
            layouts.push(layout(dt, operand, key.batch)?);
        }
        let pref = lt::create_matmul_pref().map_err(err)?;
        // SAFETY: live preference and descriptors; the preference is destroyed once.
        unsafe {
            let mut h = set_pref(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &(workspace_size as u64));
            for attr in [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ] {
                h = h.and_then(|()| set_pref(pref, attr, &key.alignment));
            }
            let (a, b, out) = (layouts[0], layouts[1], layouts[2]);
            let h = h.and_then(|()| {
                heuristic_candidates(handle, desc, [a, b, out], pref).map_err(|e| format!("no cuBLASLt algorithm for {key:?}: {e}"))
            });
            let _ = lt::destroy_matmul_pref(pref);
            h
        }
    })();
    let candidates = match heuristic {
        Ok(c) => c,
        Err(e) => {
            destroy(desc, &layouts);
            return Err(e);
        }
    };
    let layouts = [layouts[0], layouts[1], layouts[2]];
    Ok(Plan { parts: PlanParts { desc, layouts, algo: candidates[0] }, candidates })
}

/// Up to [`candidates`] algorithms for the descriptors, best first by cuBLASLt's estimate; never
/// empty on `Ok`.
unsafe fn heuristic_candidates(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    [a, b, out]: [sys::cublasLtMatrixLayout_t; 3],
    pref: sys::cublasLtMatmulPreference_t,
) -> Result<Vec<Algo>, String> {
    // SAFETY: a plain C struct, valid zeroed; cuBLASLt fills the first `count`.
    let wanted = candidates();
    let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> = vec![unsafe { std::mem::zeroed() }; wanted];
    let mut count = 0;
    // SAFETY: live descriptors; `results` holds `wanted` entries.
    unsafe { sys::cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, out, out, pref, wanted as i32, results.as_mut_ptr(), &mut count) }
        .result()
        .map_err(err)?;
    let algos: Vec<Algo> = results[..count.max(0) as usize]
        .iter()
        .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .map(|r| Algo { algo: r.algo, workspace: r.workspaceSize })
        .collect();
    if algos.is_empty() { Err("the heuristic returned none".into()) } else { Ok(algos) }
}

/// Whether `stream` is being captured into a CUDA graph.
fn capturing(stream: dsys::CUstream) -> bool {
    let mut status = dsys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream; the call only reads its capture state.
    let ok = unsafe { dsys::cuStreamIsCapturing(stream, &mut status) } == dsys::CUresult::CUDA_SUCCESS;
    ok && status != dsys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

/// The device pointer of a tensor's first element, taken through CubeCL (which also orders the
/// handle's producer against CubeCL's current stream).
fn pointer(client: &ComputeClient<CudaRuntime>, t: &CubeTensor<impl CubeRuntime>) -> Result<u64, String> {
    let resource = client.get_resource(t.handle.clone()).map_err(err)?;
    Ok(resource.resource().ptr)
}

/// The largest power-of-two byte alignment (≤ 256) of every pointer and of every operand's
/// strides (each operand with its element size).
fn alignment(ptrs: &[u64], ops: &[(Operand, usize)]) -> u32 {
    let strides = ops.iter().flat_map(|(o, elem)| [o.row_stride * elem, o.batch_stride * elem]).map(|s| s as u64);
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
    /// cuBLASLt's alpha.
    pub scale: f32,
}

/// `out = scale · op(lhs) · op(rhs) + bias + residual` through cuBLASLt, ordered against CubeCL's stream.
/// `Ok(false)` when this runtime, dtype or layout is not served (nothing was enqueued: the caller
/// uses Burn's matmul); `Err` when cuBLASLt failed after work was enqueued.
pub(crate) fn gemm<R: CubeRuntime>(args: &GemmArgs<'_, R>, device_index: usize) -> Result<bool, String> {
    let Some(client) = (&args.out.client as &dyn std::any::Any).downcast_ref::<ComputeClient<CudaRuntime>>() else {
        return Ok(false);
    };
    let dtype = args.lhs.dtype;
    if data_type(dtype).is_none() || args.rhs.dtype != dtype || args.out.dtype != out_dtype(dtype) {
        return Ok(false);
    }
    Engine::with(client, device_index, |engine| run(engine, client, args)).unwrap_or(Ok(false))
}

fn run<R: CubeRuntime>(engine: &mut Engine, client: &ComputeClient<CudaRuntime>, a: &GemmArgs<'_, R>) -> Result<bool, String> {
    let (lhs, rhs, out) = (Operand::of(a.lhs), Operand::of(a.rhs), Operand::of(a.out));
    let residual_op = a.residual.map(Operand::of);
    // kiln scales the product alone; how cuBLASLt's bias epilogue meets alpha is not relied on:
    // the (unused) scaled product with a bias is left to Burn's matmul.
    if residual_op.is_some_and(|r| r != out) || (a.bias.is_some() && a.scale != 1.0) {
        return Ok(false);
    }
    // Integer products: no epilogue, no scale (alpha is an i32).
    let dtype = a.lhs.dtype;
    if dtype == DType::I8 && (a.bias.is_some() || a.residual.is_some() || a.scale != 1.0) {
        return Ok(false);
    }
    let ptr = |t: &CubeTensor<R>| pointer(client, t);
    let (p_lhs, p_rhs, p_out) = (ptr(a.lhs)?, ptr(a.rhs)?, ptr(a.out)?);
    let p_bias = a.bias.map(ptr).transpose()?;
    let p_residual = a.residual.map(ptr).transpose()?;
    let pointers: Vec<u64> = [Some(p_lhs), Some(p_rhs), Some(p_out), p_bias, p_residual].into_iter().flatten().collect();
    let (elem, out_elem) = (dtype.size(), a.out.dtype.size());
    let key = PlanKey {
        dtype,
        layout: a.layout,
        batch: a.out.meta.shape()[0],
        lhs,
        rhs,
        out,
        bias: a.bias.is_some(),
        residual: a.residual.is_some(),
        alignment: alignment(&pointers, &[(lhs, elem), (rhs, elem), (out, out_elem)]),
    };
    let handle = engine.handle;
    let Ok((plan, candidates)) = engine.plan(key) else { return Ok(false) };
    if let Some(bias) = p_bias {
        // SAFETY: live descriptor; the plan is used under the engine's lock only.
        unsafe { set_desc(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)? };
    }
    let (alpha, beta) = (a.scale, if a.residual.is_some() { 1f32 } else { 0f32 });
    let (alpha_int, beta_int) = (1i32, 0i32);
    let (alpha_ptr, beta_ptr) = if dtype == DType::I8 {
        (&alpha_int as *const i32 as *const c_void, &beta_int as *const i32 as *const c_void)
    } else {
        (&alpha as *const f32 as *const c_void, &beta as *const f32 as *const c_void)
    };
    let c = p_residual.unwrap_or(p_out);
    let launch = |lane: Lane, algo: &Algo, p_out: u64| unsafe {
        // SAFETY: every pointer is a live CubeCL allocation of the shape its layout describes, kept
        // alive (and unreused) until CubeCL's stream passes the point ordered after this launch.
        lt::matmul(
            handle,
            plan.desc,
            alpha_ptr,
            beta_ptr,
            p_rhs as *const c_void,
            plan.layouts[0],
            p_lhs as *const c_void,
            plan.layouts[1],
            c as *const c_void,
            plan.layouts[2],
            p_out as *mut c_void,
            plan.layouts[2],
            &algo.algo,
            lane.workspace as *mut c_void,
            algo.workspace,
            lane.stream as sys::cudaStream_t,
        )
        .map_err(|e| format!("cublasLtMatmul: {e:?}"))
    };
    if candidates.is_empty() {
        return engine.ordering.ordered(client, false, |lane| launch(lane, &plan.algo, p_out)).map(|()| true);
    }
    // Timing runs must leave the output as one run would: an output that is also the residual
    // (`C = D`, accumulated in place) would take the product once a run, so they write a scratch
    // tensor instead, freed after `tune` has waited for them.
    let scratch = (p_residual == Some(p_out)).then(|| empty_like_device(a.out, a.out.shape(), a.out.dtype));
    let p_timed = scratch.as_ref().map(ptr).transpose()?.unwrap_or(p_out);
    // A plan's first product: its kernels load now (see `Ordering::ordered`) and its candidates
    // are timed, unless the stream is being captured into a CUDA graph (`backend::graph`), where
    // waiting for the timing events would break the capture: the heuristic's choice runs then,
    // and the candidates wait for the plan's next uncaptured product.
    let mut chosen = None;
    engine.ordering.ordered(client, true, |lane| {
        if capturing(lane.stream) {
            return launch(lane, &plan.algo, p_out);
        }
        let best = tune(lane.stream, &candidates, key.flops() <= GATED_FLOPS, |algo| launch(lane, algo, p_timed))?;
        chosen = Some(best);
        launch(lane, &best, p_out)
    })?;
    drop(scratch);
    let cached = engine.plans.get_mut(&key).expect("built above");
    match chosen {
        Some(algo) => cached.parts.algo = algo,
        None => cached.candidates = candidates,
    }
    Ok(true)
}

/// Wait until every cuBLASLt product enqueued on CUDA device `index` has finished (benchmarks of
/// the unordered negative control need it; ordered products never do).
pub fn cublaslt_synchronize(index: usize) {
    on_device(index, |engine| {
        // SAFETY: the engine's live stream.
        let _ = unsafe { drv::stream::synchronize(engine.ordering.own_stream()) };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gate's threshold reads a product's size through [`PlanKey::flops`]: its inner
    /// dimension is the left operand's columns, or its rows when it is transposed.
    #[test]
    fn flops_take_the_inner_dimension_of_either_layout() {
        let op = |rows, cols| Operand { rows, cols, row_stride: cols, batch_stride: rows * cols };
        let key = |transpose_lhs, lhs| PlanKey {
            dtype: DType::BF16,
            layout: GemmLayout::new(transpose_lhs, false),
            batch: 2,
            lhs,
            rhs: op(5, 7),
            out: op(3, 7),
            bias: false,
            residual: false,
            alignment: 16,
        };
        let expected = 2.0 * 2.0 * 3.0 * 7.0 * 5.0;
        assert_eq!(key(false, op(3, 5)).flops(), expected);
        assert_eq!(key(true, op(5, 3)).flops(), expected);
    }
}
