//! CUDA graphs of steps on Burn's `Cuda` backend: what a closure enqueues through Burn's fusion
//! on CubeCL's stream is captured once, in parts, and then replayed with one launch per part. A
//! decode step of a small model is ~400 kernels whose launches cost ~5 ms of host time through
//! Burn; its replay costs a few graph launches (RESULTS, twenty-sixth session: 2.4–2.6 ms a token
//! for a 0.5B model, kernels included).
//!
//! A captured step must keep three rules, which the capture cannot check:
//! - every shape, kernel and kernel argument is the same at each replay; what changes lives in
//!   device buffers that [`CudaGraph::replay`] writes before launching (e.g. a position tensor);
//! - nothing in it reads back to the host or waits for the device;
//! - between replays nothing else runs on the device. The step's intermediate buffers stay in
//!   CubeCL's memory pool, which hands them to the next allocation; the graph keeps their addresses.
//!
//! CubeCL uploads launch metadata from host memory inside the step: the capture copies each such
//! source into memory the graph owns, so the replay does not read CubeCL's reused staging.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::Runtime;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::sys as dsys;

type Inner = CubeBackend<CudaRuntime, f32, i32, u8>;

/// A tensor's device buffer, kept alive (and out of CubeCL's pool) while this is held.
pub struct DeviceBuffer {
    _tensor: CubeTensor<CudaRuntime>,
    /// Address of the first element.
    pub ptr: u64,
    pub bytes: usize,
    pub dtype: DType,
}

/// The buffer behind an integer tensor on `Cuda` (the tensor's pending work is enqueued first).
pub fn int_buffer<const D: usize>(tensor: &Tensor<Cuda, D, Int>) -> Result<DeviceBuffer, String> {
    let fusion = burn_fusion::get_client::<Inner>(&tensor.device());
    buffer(&tensor.device(), fusion.resolve_tensor_int::<Inner>(tensor.clone().into_primitive()))
}

/// The buffer behind a float tensor on `Cuda` (the tensor's pending work is enqueued first).
pub fn float_buffer<const D: usize>(tensor: &Tensor<Cuda, D>) -> Result<DeviceBuffer, String> {
    let fusion = burn_fusion::get_client::<Inner>(&tensor.device());
    buffer(&tensor.device(), fusion.resolve_tensor_float::<Inner>(tensor.clone().into_primitive().tensor()))
}

fn buffer(device: &CudaDevice, tensor: CubeTensor<CudaRuntime>) -> Result<DeviceBuffer, String> {
    let (fusion, cube) = (burn_fusion::get_client::<Inner>(device), CudaRuntime::client(device));
    let handle = tensor.handle.clone();
    // On the fusion thread, like kiln's other pointer reads: CubeCL orders the handle's producer
    // against that thread's stream.
    let ptr = fusion.sync(move || cube.get_resource(handle).map(|r| r.resource().ptr).map_err(|e| format!("{e:?}")))?;
    let bytes = tensor.meta.shape().num_elements() * tensor.dtype.size();
    Ok(DeviceBuffer { dtype: tensor.dtype, ptr, bytes, _tensor: tensor })
}

/// Node counts of a captured graph, by kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GraphNodes {
    pub kernels: usize,
    /// Host-to-device copies (their sources now owned by the graph) and bytes they move.
    pub uploads: usize,
    pub upload_bytes: usize,
    /// Other copies (device to device).
    pub copies: usize,
    pub memsets: usize,
    pub other: usize,
    /// Graphs the step was captured as (its parts).
    pub graphs: usize,
}

/// Page-locked host memory (`cuMemHostAlloc`), freed on drop.
struct Pinned {
    ptr: usize,
    len: usize,
}

impl Pinned {
    /// Call with CubeCL's context current (on its device thread).
    fn new(len: usize) -> Result<Self, String> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `ptr` receives a fresh allocation of `len` bytes (at least one).
        check("cuMemHostAlloc", unsafe { dsys::cuMemHostAlloc(&mut ptr, len.max(1), 0) })?;
        Ok(Self { ptr: ptr as usize, len })
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes allocated above, owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `cuMemHostAlloc`, freed once, by its owner (a `CudaGraph`) on
        // CubeCL's device thread after the graph that reads it is destroyed.
        unsafe { dsys::cuMemFreeHost(self.ptr as *mut std::ffi::c_void) };
    }
}

fn check(call: &str, result: dsys::CUresult) -> Result<(), String> {
    match result {
        dsys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(format!("{call} failed: {other:?}")),
    }
}

/// One instantiated graph of a step's consecutive part.
struct Segment {
    graph: usize,
    exec: usize,
    /// The uploads' sources, copied at capture time.
    _sources: Vec<Pinned>,
}

/// A captured step, instantiated and ready to replay on the stream it was captured from: one
/// graph per part of the step between the `split` calls it made.
pub struct CudaGraph {
    device: CudaDevice,
    stream: usize,
    segments: Vec<Segment>,
    nodes: GraphNodes,
    /// Staging of [`CudaGraph::replay`]'s inputs and output.
    staging: Option<Pinned>,
}

// SAFETY: the handles are plain driver handles, used only on CubeCL's device thread.
unsafe impl Send for CudaGraph {}

/// Most host-to-device uploads one captured part may hold: CubeCL waits for an event of the
/// stream every 64 uploads (to free their host buffers), and a wait on an event recorded during
/// the capture ends it. A part starts right after such a wait, so it can take 63 more.
pub const MAX_UPLOADS_PER_PART: usize = 63;

impl CudaGraph {
    /// Captures what `step` enqueues on `device` (see the module's rules) and instantiates it.
    /// `step` gets a `split` function: calling it closes the current part (its ops drained into
    /// it) and opens the next; a part must hold at most [`MAX_UPLOADS_PER_PART`] of CubeCL's
    /// metadata uploads (about a third of the kernels). Nothing of the step runs: call
    /// [`CudaGraph::replay`] for that. `step`'s result is returned with the graph (its tensors are
    /// the buffers the graph writes). On an error the capture is ended and nothing is kept; a
    /// panic inside `step` ends it too and goes on unwinding.
    pub fn capture<R>(device: &CudaDevice, step: impl FnOnce(&mut dyn FnMut()) -> R) -> Result<(Self, R), String> {
        let fusion = burn_fusion::get_client::<Inner>(device);
        let cube = CudaRuntime::client(device);
        fusion.sync(move || cubecl::future::block_on(cube.sync())).map_err(|e| format!("sync before the capture: {e:?}"))?;
        let stream = on_device_thread(device, |cube| {
            let stream = crate::ops::matmul::stream_order::learn_cubecl_stream(cube)? as usize;
            begin_part(cube, stream)?;
            Ok(stream)
        })?;
        let mut parts = Parts { device: device.clone(), stream, segments: Vec::new(), error: None };
        let out = match catch_unwind(AssertUnwindSafe(|| step(&mut || parts.split()))) {
            Ok(out) => out,
            Err(panic) => {
                let _ = catch_unwind(AssertUnwindSafe(|| on_device_thread(device, move |_| discard_capture(stream))));
                resume_unwind(panic);
            }
        };
        // Drain the fusion stream into the last part, then close it (both on the fusion thread).
        match catch_unwind(AssertUnwindSafe(|| on_device_thread(device, move |_| end_capture(stream)))) {
            Ok(Ok(last)) => parts.segments.push(last),
            Ok(Err(e)) => return Err(parts.error.take().unwrap_or(e)),
            Err(panic) => {
                let _ = catch_unwind(AssertUnwindSafe(|| on_device_thread(device, move |_| discard_capture(stream))));
                let message = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
                return Err(format!("the step failed while it was captured: {}", message.unwrap_or_default()));
            }
        }
        if let Some(e) = parts.error.take() {
            return Err(e);
        }
        let mut nodes = GraphNodes::default();
        for (_, counted) in &parts.segments {
            nodes.add(counted);
        }
        let segments = std::mem::take(&mut parts.segments).into_iter().map(|(segment, _)| segment).collect();
        Ok((Self { device: device.clone(), stream, segments, nodes, staging: None }, out))
    }

    /// Node counts over all parts.
    pub fn nodes(&self) -> GraphNodes {
        self.nodes
    }

    /// Writes `uploads` (`(device address, bytes)`), launches the graph, then copies
    /// `download_len` bytes from device address `download` back and waits for it all.
    pub fn replay(&mut self, uploads: &[(u64, &[u8])], download: u64, download_len: usize) -> Result<Vec<u8>, String> {
        let uploads: Vec<(u64, Vec<u8>)> = uploads.iter().map(|&(dst, bytes)| (dst, bytes.to_vec())).collect();
        let needed = uploads.iter().map(|(_, b)| b.len()).sum::<usize>() + download_len;
        let stream = self.stream;
        let execs: Vec<usize> = self.segments.iter().map(|s| s.exec).collect();
        let staging = self.staging.take();
        let (staging, result) = on_device_thread(&self.device, move |_| {
            let mut staging = match staging {
                Some(s) if s.len >= needed => s,
                _ => Pinned::new(needed)?,
            };
            let result = launch(&mut staging, stream as dsys::CUstream, &execs, &uploads, download, download_len);
            Ok((staging, result))
        })?;
        self.staging = Some(staging);
        result
    }
}

/// The parts of a capture in progress.
struct Parts {
    device: CudaDevice,
    stream: usize,
    segments: Vec<(Segment, GraphNodes)>,
    /// The first failure; later parts are still captured (and dropped) so nothing runs.
    error: Option<String>,
}

impl Parts {
    /// Closes the current part and opens the next.
    fn split(&mut self) {
        let stream = self.stream;
        let closed = on_device_thread(&self.device, move |cube| {
            let closed = end_capture(stream);
            // Open the next part even after a failure, so that the step's remaining ops are
            // captured and dropped rather than run.
            begin_part(cube, stream)?;
            Ok(closed)
        });
        match closed.and_then(|c| c) {
            Ok(segment) => self.segments.push(segment),
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
    }
}

impl GraphNodes {
    fn add(&mut self, other: &GraphNodes) {
        self.kernels += other.kernels;
        self.uploads += other.uploads;
        self.upload_bytes += other.upload_bytes;
        self.copies += other.copies;
        self.memsets += other.memsets;
        self.other += other.other;
        self.graphs += other.graphs;
    }
}

/// Opens a capture on `stream` after flushing CubeCL's queue of uploaded host buffers, so that
/// the event its next flush waits for was recorded before the capture (see
/// [`MAX_UPLOADS_PER_PART`]).
fn begin_part(cube: &cubecl::prelude::ComputeClient<CudaRuntime>, stream: usize) -> Result<(), String> {
    cube.flush().map_err(|e| format!("{e:?}"))?;
    // SAFETY: a live stream of this context. Relaxed mode lets CubeCL's other driver calls
    // (allocations, queries) run while the capture is open.
    check("cuStreamBeginCapture", unsafe { dsys::cuStreamBeginCapture_v2(stream as dsys::CUstream, dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) })
}

/// One replay on `stream`: uploads through `staging`, the graphs in order, the download, the wait.
fn launch(staging: &mut Pinned, stream: dsys::CUstream, execs: &[usize], uploads: &[(u64, Vec<u8>)], download: u64, len: usize) -> Result<Vec<u8>, String> {
    let base = staging.ptr;
    let mut at = 0;
    for (dst, bytes) in uploads {
        staging.bytes()[at..at + bytes.len()].copy_from_slice(bytes);
        // SAFETY: `dst` is a live device buffer of at least `bytes.len()` bytes (the caller's);
        // the source is page-locked staging that outlives the copy (the wait below).
        check("cuMemcpyHtoDAsync", unsafe { dsys::cuMemcpyHtoDAsync_v2(*dst, (base + at) as *const _, bytes.len(), stream) })?;
        at += bytes.len();
    }
    for &exec in execs {
        // SAFETY: an instantiated graph of this context, launched on the stream it was captured on.
        check("cuGraphLaunch", unsafe { dsys::cuGraphLaunch(exec as dsys::CUgraphExec, stream) })?;
    }
    // SAFETY: `download` is a live device buffer of `len` bytes; the staging has room for them.
    check("cuMemcpyDtoHAsync", unsafe { dsys::cuMemcpyDtoHAsync_v2((base + at) as *mut _, download, len, stream) })?;
    // SAFETY: the captured stream.
    check("cuStreamSynchronize", unsafe { dsys::cuStreamSynchronize(stream) })?;
    Ok(staging.bytes()[at..at + len].to_vec())
}

impl Drop for CudaGraph {
    /// Destroys the graphs and then frees their page-locked sources and the staging buffer, all on
    /// CubeCL's device thread (its context current), not on whichever thread drops the graph.
    fn drop(&mut self) {
        let (segments, staging) = (std::mem::take(&mut self.segments), self.staging.take());
        let _ = on_device_thread(&self.device, move |_| {
            for segment in segments {
                // SAFETY: created by the capture, destroyed once; replays waited for their end.
                unsafe {
                    dsys::cuGraphExecDestroy(segment.exec as dsys::CUgraphExec);
                    dsys::cuGraphDestroy(segment.graph as dsys::CUgraph);
                }
                drop(segment);
            }
            drop(staging);
            Ok(())
        });
    }
}

/// Runs `f` on CubeCL's device thread (its context current) after draining Burn's fusion stream,
/// from the fusion thread, whose CubeCL stream is the one the step's kernels go to.
fn on_device_thread<R: Send + 'static>(
    device: &CudaDevice,
    f: impl FnOnce(&cubecl::prelude::ComputeClient<CudaRuntime>) -> Result<R, String> + Send + 'static,
) -> Result<R, String> {
    let fusion = burn_fusion::get_client::<Inner>(device);
    let cube = CudaRuntime::client(device);
    fusion.sync(move || cube.exclusive(|| f(&cube)).map_err(|e| format!("{e:?}"))?)
}

/// Ends a capture whose step failed, dropping what it recorded.
fn discard_capture(stream: usize) -> Result<(), String> {
    let mut graph: dsys::CUgraph = std::ptr::null_mut();
    // SAFETY: the capturing stream; a graph it returns is destroyed at once.
    unsafe {
        dsys::cuStreamEndCapture(stream as dsys::CUstream, &mut graph);
        if !graph.is_null() {
            dsys::cuGraphDestroy(graph);
        }
    }
    Ok(())
}

/// Ends the capture on `stream`, gives its uploads owned sources and instantiates the graph.
fn end_capture(stream: usize) -> Result<(Segment, GraphNodes), String> {
    let mut graph: dsys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream the capture began on; `graph` receives the captured graph or stays null.
    check("cuStreamEndCapture", unsafe { dsys::cuStreamEndCapture(stream as dsys::CUstream, &mut graph) })?;
    let instantiated = own_uploads(graph).and_then(|(nodes, sources)| {
        let mut exec: dsys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a complete graph of this context.
        check("cuGraphInstantiate", unsafe { dsys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) })?;
        Ok((Segment { graph: graph as usize, exec: exec as usize, _sources: sources }, GraphNodes { graphs: 1, ..nodes }))
    });
    if instantiated.is_err() {
        // SAFETY: the graph is not instantiated and nothing else holds it.
        unsafe { dsys::cuGraphDestroy(graph) };
    }
    instantiated
}

/// Counts the graph's nodes and points every host-to-device copy at a page-locked copy of its
/// source as the capture left it.
fn own_uploads(graph: dsys::CUgraph) -> Result<(GraphNodes, Vec<Pinned>), String> {
    use dsys::CUgraphNodeType as T;
    let mut count = 0usize;
    // SAFETY: the first call only reads the node count; the second fills `count` nodes.
    check("cuGraphGetNodes", unsafe { dsys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) })?;
    let mut all = vec![std::ptr::null_mut(); count];
    check("cuGraphGetNodes", unsafe { dsys::cuGraphGetNodes(graph, all.as_mut_ptr(), &mut count) })?;
    let (mut nodes, mut sources) = (GraphNodes::default(), Vec::new());
    for &node in &all[..count] {
        let mut kind = T::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of the graph.
        check("cuGraphNodeGetType", unsafe { dsys::cuGraphNodeGetType(node, &mut kind) })?;
        match kind {
            T::CU_GRAPH_NODE_TYPE_KERNEL => nodes.kernels += 1,
            T::CU_GRAPH_NODE_TYPE_MEMSET => nodes.memsets += 1,
            T::CU_GRAPH_NODE_TYPE_MEMCPY => match own_upload(node)? {
                Some(source) => {
                    nodes.uploads += 1;
                    nodes.upload_bytes += source.len;
                    sources.push(source);
                }
                None => nodes.copies += 1,
            },
            _ => nodes.other += 1,
        }
    }
    Ok((nodes, sources))
}

/// For a host-to-device copy node: its source copied into page-locked memory the node now reads.
fn own_upload(node: dsys::CUgraphNode) -> Result<Option<Pinned>, String> {
    let mut params = std::mem::MaybeUninit::<dsys::CUDA_MEMCPY3D>::uninit();
    // SAFETY: a memcpy node; on success the driver wrote the whole struct.
    check("cuGraphMemcpyNodeGetParams", unsafe { dsys::cuGraphMemcpyNodeGetParams(node, params.as_mut_ptr()) })?;
    let mut params = unsafe { params.assume_init() };
    if params.srcMemoryType != dsys::CUmemorytype::CU_MEMORYTYPE_HOST {
        return Ok(None);
    }
    if params.Height > 1 || params.Depth > 1 || params.srcY != 0 || params.srcZ != 0 || params.srcLOD != 0 {
        return Err(format!("a captured upload is not one row of bytes ({} × {} × {})", params.WidthInBytes, params.Height, params.Depth));
    }
    let len = params.WidthInBytes;
    let mut source = Pinned::new(len)?;
    // SAFETY: the node reads `len` bytes from `srcHost + srcXInBytes`, host memory the capture's
    // uploader still holds (nothing ran since the capture ended).
    let from = unsafe { std::slice::from_raw_parts((params.srcHost as *const u8).add(params.srcXInBytes), len) };
    source.bytes().copy_from_slice(from);
    params.srcHost = source.ptr as *const _;
    params.srcXInBytes = 0;
    // SAFETY: the same node, its source now the page-locked copy that the graph keeps.
    check("cuGraphMemcpyNodeSetParams", unsafe { dsys::cuGraphMemcpyNodeSetParams(node, &params) })?;
    Ok(Some(source))
}

/// Bytes in use and bytes reserved by CubeCL's memory pool of the calling thread's stream on
/// `device`: what a generation holds (weights, KV cache, graph buffers) and what its pool took.
pub fn pool_usage(device: &CudaDevice) -> Result<(u64, u64), String> {
    let usage = CudaRuntime::client(device).memory_usage().map_err(|e| format!("{e:?}"))?;
    Ok((usage.bytes_in_use, usage.bytes_reserved))
}
