//! cuBLASLt on the device memory of CubeCL tensors (CUDA only).
//!
//! cuBLASLt is loaded at run time through `cudarc` (the crate cubecl-cuda already uses for the
//! driver), so a machine without it still runs: [`Engine::get`] answers `None` and the caller
//! falls back to Burn's matmul.
//!
//! Ordering against CubeCL: CubeCL 0.10 keeps the `CUstream` it launches on private, so kiln
//! owns one stream per device for cuBLASLt and orders it against CubeCL's with host
//! synchronization ([`StreamOrder::HostSync`]): wait for CubeCL's stream to drain, run the
//! product, wait for it. Events need the other stream's handle; the driver's stream memory
//! operations (`cuStreamWaitValue32`) rejected CubeCL's pool memory on the H100; a device-side
//! handshake through flag words (a spinning CubeCL kernel on one side, spinning kernels on kiln's
//! stream on the other) did not complete a round there (git history, `benches/RESULTS.md`). The
//! two host waits cost ~0.1-0.2 ms per product, which is why `cube.rs` sends small products to
//! Burn's matmul.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use burn::tensor::DType;
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{result as drv, sys as dsys};

use super::GemmLayout;

/// How the cuBLASLt stream is ordered against CubeCL's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamOrder {
    /// Host waits for CubeCL's stream before the product and for the product after it.
    HostSync,
    /// No ordering at all: wrong results whenever a producer or consumer overlaps the product.
    /// Exists only as the negative control of the GPU check's ordering test
    /// (`KILN_GEMM_ORDER=unordered`), which must fail with it.
    Unordered,
}

fn stream_order() -> StreamOrder {
    match std::env::var("KILN_GEMM_ORDER").as_deref() {
        Ok("unordered") => StreamOrder::Unordered,
        _ => StreamOrder::HostSync,
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
    /// cuBLASLt's A and B layouts (A = the rhs tensor, B = the lhs tensor: see [`build_plan`]),
    /// then the output's, which serves as both C (the residual) and D.
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: usize,
}

/// The owner of one cached [`PlanParts`].
struct Plan(PlanParts);

impl Drop for Plan {
    fn drop(&mut self) {
        destroy(self.0.desc, &self.0.layouts);
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

/// Per-device cuBLASLt state: handle, kiln's stream, workspace and the plan cache.
pub(crate) struct Engine {
    context: dsys::CUcontext,
    handle: sys::cublasLtHandle_t,
    stream: dsys::CUstream,
    workspace: dsys::CUdeviceptr,
    workspace_size: usize,
    order: StreamOrder,
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
        Ok(Self { context, handle, stream, workspace, workspace_size, order: stream_order(), plans: HashMap::new() })
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
    let mut layouts = Vec::with_capacity(3);
    let heuristic = (|| {
        // SAFETY: live descriptors, attribute values of the documented types.
        unsafe {
            // Column-major outᵀ = op(rhs)ᵀ · op(lhs)ᵀ: cuBLASLt's A is the rhs tensor, its B the lhs.
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(key.layout.transpose_rhs))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(key.layout.transpose_lhs))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        }
        for operand in [&key.rhs, &key.lhs, &key.out] {
            layouts.push(layout(dt, operand, key.batch)?);
        }
        let pref = lt::create_matmul_pref().map_err(|e| format!("{e:?}"))?;
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
                lt::get_matmul_algo_heuristic(handle, desc, a, b, out, out, pref)
                    .map_err(|e| format!("no cuBLASLt algorithm for {key:?}: {e:?}"))
            });
            let _ = lt::destroy_matmul_pref(pref);
            h
        }
    })();
    let heuristic = match heuristic {
        Ok(h) => h,
        Err(e) => {
            destroy(desc, &layouts);
            return Err(e);
        }
    };
    let layouts = [layouts[0], layouts[1], layouts[2]];
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
    let (handle, stream, workspace, order) = (engine.handle, engine.stream, engine.workspace, engine.order);
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
            plan.layouts[2],
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
    };
    outcome.map(|()| true)
}
