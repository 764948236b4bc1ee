//! Hand-written CUDA C++ kernels launched through CubeCL's own CUDA runtime.
//!
//! CubeCL 0.10's IR has no Hopper warpgroup MMA (`wgmma`); a kernel that needs it is CUDA C++
//! with inline PTX. Handing that source to CubeCL as a [`CubeTask`] keeps everything else
//! CubeCL's: NVRTC compilation (CubeCL compiles for `sm_90a` on Hopper, which `wgmma` needs),
//! its kernel cache, its buffers (device pointers include the handles' offsets) and its stream,
//! so the launch is ordered with every other CubeCL kernel and Burn op.
//!
//! Launch convention (what cubecl-cuda passes to `cuLaunchKernel`): each tensor map by value
//! (`const __grid_constant__`, 64-byte aligned; CubeCL encodes it at launch on its tensor's device
//! pointer), then one pointer per tensor map's tensor and per buffer in binding order, then the
//! scalars as one struct by value (`const __grid_constant__`), laid out as consecutive 32-bit
//! words.

use cubecl::cuda::{CudaCompiler, CudaComputeKernel, CudaRuntime};
use cubecl::ir::{ElemType, FloatKind as IrFloat, StorageType, UIntKind};
use cubecl::prelude::*;
use cubecl::server::{Binding, KernelArguments, MetadataBindingInfo, TensorMapBinding, TensorMapMeta};
use cubecl::zspace::metadata::Metadata;
use cubecl::{CompilationError, Compiler, CubeTask};
use cubecl_cpp::shared::{Body, ComputeKernel, Elem, Flags, Item, SharedMemory};

/// `out_t` and `kiln_out`: the output element a kernel's `KILN_OUT_KIND` names, for the CUDA C++
/// kernels that write f32, f16 or bf16 (placed before their source).
pub const OUT_ELEMENT: &str = include_str!("cuda_out.cuh");

/// Element type of a CUDA C++ kernel's float inputs and outputs, as its `KILN_*_KIND` defines
/// number them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatKind {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
}

/// One compiled variant of a CUDA C++ kernel: what distinguishes it from other variants, and
/// how to produce its source (called once per variant, on a cache miss).
pub struct CudaSourceKernel {
    /// The `extern "C"` entry point in the source.
    pub entry: &'static str,
    /// Identifies the variant in CubeCL's caches: the source's fingerprint and its parameters.
    pub key: (u64, Vec<u32>),
    pub cube_dim: CubeDim,
    /// Dynamic shared memory per cube, in bytes.
    pub shared_bytes: usize,
    pub source: fn(&[u32]) -> String,
}

/// FNV-1a over source texts, for kernel cache keys: a changed source must not reuse PTX that
/// CubeCL cached on disk for the old one.
pub const fn fingerprint(texts: &[&str]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let mut t = 0;
    while t < texts.len() {
        let bytes = texts[t].as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            hash = (hash ^ bytes[i] as u64).wrapping_mul(0x0100_0000_01b3);
            i += 1;
        }
        t += 1;
    }
    hash
}

impl KernelMetadata for CudaSourceKernel {
    fn name(&self) -> &'static str {
        self.entry
    }

    fn id(&self) -> KernelId {
        KernelId::new::<Self>().info((self.entry, self.key.clone(), self.shared_bytes)).cube_dim(self.cube_dim)
    }

    fn address_type(&self) -> StorageType {
        StorageType::Scalar(ElemType::UInt(UIntKind::U32))
    }
}

impl CubeTask<CudaCompiler> for CudaSourceKernel {
    fn compile(
        &self,
        _compiler: &mut CudaCompiler,
        _options: &<CudaCompiler as Compiler>::CompilationOptions,
        _mode: ExecutionMode,
        _address_type: StorageType,
    ) -> Result<CompiledKernel<CudaCompiler>, CompilationError> {
        Ok(CompiledKernel {
            entrypoint_name: self.entry.to_string(),
            debug_name: Some(self.entry),
            source: (self.source)(&self.key.1),
            repr: Some(self.representation()),
            cube_dim: self.cube_dim,
            debug_info: None,
        })
    }
}

impl CudaSourceKernel {
    /// cubecl-cuda reads a kernel's dynamic shared memory size (to validate it, raise the
    /// function's limit and pass it to the launch) from the compiled representation, which a
    /// source kernel does not have: this one declares only that.
    fn representation(&self) -> CudaComputeKernel {
        let shared = SharedMemory::Array { index: 0, item: Item::new(Elem::U8, 1, true), length: self.shared_bytes, align: 1024, offset: 0 };
        ComputeKernel {
            tensor_maps: vec![],
            buffers: vec![],
            scalars: vec![],
            info: Default::default(),
            meta_static_len: 0,
            body: Body {
                instructions: vec![],
                shared_memories: if self.shared_bytes > 0 { vec![shared] } else { vec![] },
                pipelines: vec![],
                barriers: vec![],
                const_arrays: vec![],
                local_arrays: vec![],
                info_by_ptr: false,
                has_dynamic_meta: false,
                address_type: Item::new(Elem::U32, 1, true),
            },
            cube_dim: self.cube_dim,
            cluster_dim: None,
            extensions: vec![],
            flags: Flags::default(),
            items: Default::default(),
            kernel_name: self.entry.to_string(),
        }
    }

    /// Enqueues the kernel on `client`'s stream with `buffers` and the 32-bit `scalars`.
    pub fn launch(self, client: &ComputeClient<CudaRuntime>, cubes: CubeCount, buffers: Vec<Binding>, scalars: &[u32]) {
        self.launch_with_maps(client, cubes, vec![], buffers, scalars);
    }

    /// [`Self::launch`] with tensor maps before the buffers.
    pub fn launch_with_maps(self, client: &ComputeClient<CudaRuntime>, cubes: CubeCount, maps: Vec<TensorMapBinding>, buffers: Vec<Binding>, scalars: &[u32]) {
        let mut words = vec![0u64; scalars.len().div_ceil(2)];
        for (i, &w) in scalars.iter().enumerate() {
            words[i / 2] |= (w as u64) << (32 * (i % 2));
        }
        // The dynamic part starting at the end: no extra metadata pointer before the struct.
        let length = words.len();
        let arguments = KernelArguments::new().with_tensor_maps(maps).with_buffers(buffers).with_info(MetadataBindingInfo::new(words, length));
        client.launch(Box::new(self), cubes, arguments);
    }
}

/// A tensor map over a dense row-major `[rows, cols]` matrix of `elem` for a kernel's TMA copies:
/// boxes of `box_rows × box_cols` elements stored in the 128-byte swizzle (a box row must be 128
/// bytes: 64 halves), zeros outside the matrix, 256-byte L2 promotion. The matrix must start on a
/// 16-byte boundary and its rows be a multiple of 16 bytes (the caller checks).
pub fn swizzled_tile_map(binding: Binding, elem: FloatKind, [rows, cols]: [usize; 2], [box_rows, box_cols]: [usize; 2]) -> TensorMapBinding {
    let kind = match elem {
        FloatKind::F32 => IrFloat::F32,
        FloatKind::F16 => IrFloat::F16,
        FloatKind::Bf16 => IrFloat::BF16,
    };
    let map = TensorMapMeta {
        format: TensorMapFormat::Tiled(TiledArgs { tile_size: [box_rows, box_cols].into() }),
        metadata: Metadata::new([rows, cols], [cols, 1]),
        elem_stride: [1, 1].into(),
        interleave: TensorMapInterleave::None,
        swizzle: TensorMapSwizzle::B128,
        prefetch: TensorMapPrefetch::B256,
        oob_fill: OobFill::Zero,
        storage_ty: StorageType::Scalar(ElemType::Float(kind)),
    };
    TensorMapBinding { binding, map }
}
