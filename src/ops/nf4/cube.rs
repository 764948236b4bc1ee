//! 4-bit weights on CubeCL backends: quantization and dequantization kernels, the GEMV for few
//! activation rows (on CUDA's tensor cores for f16/bf16, the portable kernel elsewhere), on
//! Hopper a GEMM that makes the weight's operand in registers for prefill-sized products, and
//! dequantize-then-GEMM (kiln's `gemm`: cuBLASLt on CUDA) for the rest and for the input
//! gradient.

use burn::tensor::{DType, Shape, TensorData, TensorMetadata, ops::{FloatTensor, FloatTensorOps}};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::nf4::{ScaleArgs, gemv_fits, launch_dequantize, launch_gemv, launch_quantize};

use super::{Layout4, Nf4Backend, Parts4, QuantType, Quantized4Primitive, Scales};
use crate::backend::cube::{dense, dense_f32, dense_words, empty_like_device, storage};
use crate::ops::matmul::{GemmLayout, GemmViews, MatmulBackend};

type Weight<R> = Parts4<CubeTensor<R>, CubeTensor<R>>;

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> Nf4Backend for CubeBackend<R, F, I, BT> {
    fn quantize_4bit(weight: FloatTensor<Self>, kind: QuantType, block: usize) -> Quantized4Primitive<Self> {
        let weight = dense(weight);
        let shape = weight.shape();
        let layout = Layout4 { n: shape[0], k: shape[1], kind, block };
        let words = empty_like_device(&weight, [layout.words()], DType::I32);
        let absmax = empty_like_device(&weight, [layout.blocks()], DType::F32);
        let thresholds = host_floats::<R, F, I, BT>(kind.thresholds(), &weight);
        let code = host_floats::<R, F, I, BT>(kind.code(), &weight);
        launch_quantize(
            &weight.client.clone(),
            storage(&weight),
            layout.len(),
            block,
            kind == QuantType::Fp4,
            weight.into_array_arg(),
            thresholds.into_array_arg(),
            words.clone().into_array_arg(),
            absmax.clone().into_array_arg(),
        );
        Parts4 { words, code, scales: Scales::Absmax(absmax), layout }
    }

    fn dequantize_4bit(weight: Quantized4Primitive<Self>, dtype: DType) -> FloatTensor<Self> {
        let weight = dense_parts::<R, F, I, BT>(weight);
        let l = weight.layout;
        let out = empty_like_device(&weight.code, [l.n, l.k], dtype);
        launch_dequantize(
            &out.client.clone(),
            storage(&out),
            l.len(),
            l.block,
            weight.words.clone().into_array_arg(),
            weight.code.clone().into_array_arg(),
            scale_args(&weight),
            out.clone().into_array_arg(),
        );
        out
    }

    fn matmul_4bit(x: FloatTensor<Self>, weight: Quantized4Primitive<Self>) -> FloatTensor<Self> {
        let (m, k, l) = (x.shape()[0], x.shape()[1], weight.layout);
        match path(&x, m, l) {
            #[cfg(feature = "cuda")]
            Path::GemvMma(kind) => return mma::product(kind, dense(x), &dense_parts::<R, F, I, BT>(weight), mma::launch_gemv_mma),
            #[cfg(feature = "cuda")]
            Path::Gemm(kind) => return mma::product(kind, dense(x), &dense_parts::<R, F, I, BT>(weight), mma::launch_gemm),
            Path::Dequantize => {
                let w = Self::dequantize_4bit(weight, x.dtype);
                let views = GemmViews::new(Shape::new([1, m, k]), Shape::new([1, l.n, k]), Shape::new([m, l.n]), GemmLayout::new(false, true));
                return Self::gemm(x, w, None, None, views);
            }
            Path::Gemv => {}
        }
        let (x, weight) = (dense(x), dense_parts::<R, F, I, BT>(weight));
        let out = empty_like_device(&x, [m, l.n], x.dtype);
        launch_gemv(
            &x.client.clone(),
            storage(&x),
            m,
            l.n,
            k,
            l.block,
            x.into_array_arg(),
            weight.words.clone().into_array_arg(),
            weight.code.clone().into_array_arg(),
            scale_args(&weight),
            out.clone().into_array_arg(),
        );
        out
    }

    fn matmul_4bit_input_grad(dy: FloatTensor<Self>, weight: Quantized4Primitive<Self>) -> FloatTensor<Self> {
        let (m, l) = (dy.shape()[0], weight.layout);
        let w = Self::dequantize_4bit(weight, dy.dtype);
        let views = GemmViews::new(Shape::new([1, m, l.n]), Shape::new([1, l.n, l.k]), Shape::new([m, l.k]), GemmLayout::default());
        Self::gemm(dy, w, None, None, views)
    }
}

/// How [`Nf4Backend::matmul_4bit`] multiplies `rows` rows of `x` (`[.., k]`) by a 4-bit weight.
enum Path {
    /// CUDA's tensor-core GEMV, half precision, a few rows.
    #[cfg(feature = "cuda")]
    GemvMma(kiln_kernels::cuda_source::FloatKind),
    /// Hopper's GEMM that makes the weight's operand in registers.
    #[cfg(feature = "cuda")]
    Gemm(kiln_kernels::cuda_source::FloatKind),
    /// The portable GEMV, a few rows.
    Gemv,
    /// A dequantized temporary weight and kiln's GEMM.
    Dequantize,
}

fn path<R: CubeRuntime>(x: &CubeTensor<R>, rows: usize, l: Layout4) -> Path {
    #[cfg(feature = "cuda")]
    if let Some(kind) = mma::takes(x, rows, l) {
        return Path::GemvMma(kind);
    }
    #[cfg(feature = "cuda")]
    if let Some(kind) = mma::takes_gemm(x, rows, l) {
        return Path::Gemm(kind);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = x;
    if gemv_fits(rows, l.k) { Path::Gemv } else { Path::Dequantize }
}

/// Whether [`Nf4Backend::matmul_4bit`] multiplies `rows` rows of `x` (`[.., k]`) on CUDA by the
/// packed weight itself (a GEMV, or on Hopper the GEMM that makes the weight's operand in
/// registers) rather than through a dequantized temporary and kiln's GEMM.
#[cfg(feature = "cuda")]
pub(crate) fn reads_packed<R: CubeRuntime>(x: &CubeTensor<R>, rows: usize, l: Layout4) -> bool {
    !matches!(path(x, rows, l), Path::Dequantize)
}

/// Every part dense, the words (and nested codes) in a 32-bit int dtype, which the kernels read
/// as u32 (a backend with 64-bit ints holds the words sign-extended; the cast keeps their low 32
/// bits), and the scales and code books in f32.
fn dense_parts<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(weight: Quantized4Primitive<CubeBackend<R, F, I, BT>>) -> Weight<R> {
    weight.map(dense_words::<R, F, I, BT>, dense_f32::<R, F, I, BT>)
}

/// The weight's scale tensors in the kernels' order (absmax, the blocks' 8-bit codes, the
/// nested code book, the offset) and whether they are nested: plain absmax fills the unread
/// nested slots.
fn scale_parts<R: CubeRuntime>(weight: &Weight<R>) -> ([&CubeTensor<R>; 4], bool) {
    match &weight.scales {
        Scales::Absmax(a) => ([a, a, a, a], false),
        Scales::Nested { codes, code, absmax, offset } => ([absmax, codes, code, offset], true),
    }
}

/// The portable kernels' scale bindings.
fn scale_args<R: CubeRuntime>(weight: &Weight<R>) -> ScaleArgs<R> {
    let ([absmax, absmax_codes, nested_code, offset], nested) = scale_parts(weight);
    ScaleArgs {
        absmax: absmax.clone().into_array_arg(),
        absmax_codes: absmax_codes.clone().into_array_arg(),
        nested_code: nested_code.clone().into_array_arg(),
        offset: offset.clone().into_array_arg(),
        nested,
    }
}

/// An f32 tensor of host `values` on the device of `like`.
fn host_floats<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(values: &[f32], like: &CubeTensor<R>) -> CubeTensor<R> {
    let data = TensorData::new(values.to_vec(), [values.len()]);
    CubeBackend::<R, F, I, BT>::float_from_data(data, &like.device)
}

/// The tensor-core GEMV for half-precision activations on CUDA (`kiln_kernels::nf4::mma`) and
/// the GEMM on Hopper's warpgroup MMA (`kiln_kernels::nf4::wgmma`).
#[cfg(feature = "cuda")]
mod mma {
    use burn::tensor::TensorMetadata;
    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
    use kiln_kernels::cuda_source::FloatKind;
    use cubecl::{cuda::CudaRuntime, prelude::ComputeClient};
    pub(super) use kiln_kernels::nf4::mma::launch_gemv_mma;
    use kiln_kernels::nf4::mma::{MmaArgs, enabled, mma_fits};
    pub(super) use kiln_kernels::nf4::wgmma::launch_gemm;
    use kiln_kernels::nf4::wgmma::serves;

    use super::{Layout4, Weight, scale_parts};
    use crate::backend::cube::cuda::{self, binding};
    use crate::backend::cube::empty_like_device;

    /// The element kind, if the kernel takes `x · Wᵀ` for `m` rows of `x`: `x` f16 or bf16 on a CUDA device of
    /// compute capability 8.0 or up (bf16 MMA), its buffer 16-byte aligned (making it dense keeps
    /// the offset or copies into a fresh, aligned buffer), a shape that [`mma_fits`], and the
    /// kernel [`enabled`].
    pub(super) fn takes<R: CubeRuntime>(x: &CubeTensor<R>, m: usize, l: Layout4) -> Option<FloatKind> {
        let kind = cuda::float_kind(x.dtype)?;
        let aligned = x.handle.offset_start.unwrap_or(0).is_multiple_of(16);
        (enabled() && aligned && mma_fits(kind, m, l.n, l.k, l.block) && cuda::client(x).is_some() && cuda::capable(x, (8, 0))).then_some(kind)
    }

    /// The element kind, if the warpgroup-MMA GEMM takes `x · Wᵀ` for `m` rows of `x`: `x` f16 or bf16 on a CUDA
    /// device of compute capability 9.0, its buffer 16-byte aligned (its tensor map needs it), and
    /// a shape the kernel [`serves`].
    pub(super) fn takes_gemm<R: CubeRuntime>(x: &CubeTensor<R>, m: usize, l: Layout4) -> Option<FloatKind> {
        let kind = cuda::float_kind(x.dtype)?;
        let aligned = x.handle.offset_start.unwrap_or(0).is_multiple_of(16);
        cuda::client(x)?;
        let hopper = cuda::compute_capability(cuda::device_index(x)?)? == (9, 0);
        (aligned && hopper && serves(kind, m, l.n, l.k, l.block)).then_some(kind)
    }

    /// The kernels' bindings of a product of `x` with `weight` into `out`.
    fn args<R: CubeRuntime>(x: &CubeTensor<R>, weight: &Weight<R>, out: &CubeTensor<R>) -> MmaArgs {
        let ([absmax, absmax_codes, nested_code, offset], _) = scale_parts(weight);
        MmaArgs {
            x: binding(x),
            words: binding(&weight.words),
            code: binding(&weight.code),
            absmax: binding(absmax),
            absmax_codes: binding(absmax_codes),
            nested_code: binding(nested_code),
            offset: binding(offset),
            out: binding(out),
        }
    }

    /// A kernel's launch: `launch_gemv_mma` or `launch_gemm`.
    pub(super) type Launch = fn(&ComputeClient<CudaRuntime>, FloatKind, usize, usize, usize, usize, bool, MmaArgs);

    /// Enqueues the product of a dense `x` with `weight` by `launch`, a kernel that [`takes`] or
    /// [`takes_gemm`] checked.
    pub(super) fn product<R: CubeRuntime>(kind: FloatKind, x: CubeTensor<R>, weight: &Weight<R>, launch: Launch) -> CubeTensor<R> {
        let client = cuda::client(&x).expect("`takes` checked the runtime");
        let (m, l) = (x.shape()[0], weight.layout);
        let out = empty_like_device(&x, [m, l.n], x.dtype);
        let nested = scale_parts(weight).1;
        launch(client, kind, m, l.n, l.k, l.block, nested, args(&x, weight, &out));
        out
    }
}
