//! Dense products on CubeCL backends, by shape: products of few rows (decode-time linear layers)
//! run kiln's skinny kernel on every runtime (see [`skinny_wins`]); the others run cuBLASLt on CUDA
//! and Burn's autotuned matmul elsewhere (wgpu, f64, cuBLASLt missing).
//! `KILN_GEMM=burn|cublaslt|skinny` forces a path where it applies (for measurements).

use burn::tensor::{DType, TensorMetadata, ops::{FloatTensor, FloatTensorOps}};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::matmul::{SkinnyProblem, launch_skinny, launch_skinny_combine};

use super::{GemmLayout, GemmViews, MatmulBackend, output_shape, reference, viewed};
use crate::backend::cube::{dense, empty_like_device, storage};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> MatmulBackend for CubeBackend<R, F, I, BT> {
    fn gemm(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        residual: Option<FloatTensor<Self>>,
        views: GemmViews,
    ) -> FloatTensor<Self> {
        // Reshapes of CubeCL tensors are metadata changes (copies only for views that need them).
        let (lhs, rhs, residual) = viewed::<Self>(lhs, rhs, residual, &views);
        let path = Path::from_env();
        let mut out = None;
        // The skinny kernel has no scale in its epilogue: scaled products take the other paths.
        if matches!(path, Path::Auto | Path::Skinny) && views.scale == 1.0 {
            let cublaslt_next = path == Path::Auto && on_cuda(&lhs);
            let wanted = |p: &SkinnyProblem| !cublaslt_next || skinny_wins(p);
            out = skinny(&lhs, &rhs, bias.as_ref(), residual.as_ref(), views.layout, wanted);
        }
        #[cfg(feature = "cuda")]
        let residual = if out.is_none() && path != Path::Burn {
            match cuda::gemm(&lhs, &rhs, bias.as_ref(), residual, views.layout, views.scale) {
                Ok(product) => {
                    out = Some(product);
                    None
                }
                Err(residual) => residual,
            }
        } else {
            residual
        };
        let out = out.unwrap_or_else(|| reference::product::<Self>(lhs, rhs, bias, residual, views.layout, views.scale));
        Self::float_reshape(out, views.out)
    }
}

/// The path `KILN_GEMM` asks for; `Auto` (unset) picks by shape and backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Auto,
    Burn,
    Cublaslt,
    Skinny,
}

impl Path {
    fn from_env() -> Self {
        match std::env::var("KILN_GEMM").as_deref() {
            Ok("burn") => Self::Burn,
            Ok("cublaslt") => Self::Cublaslt,
            Ok("skinny") => Self::Skinny,
            _ => Self::Auto,
        }
    }
}

/// Whether the tensor lives on CUDA, where products that leave the skinny kernel go to cuBLASLt.
fn on_cuda<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    #[cfg(feature = "cuda")]
    return crate::backend::cube::cuda::device_index(t).is_some();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = t;
        false
    }
}

/// Whether the skinny kernel beats cuBLASLt for this product on CUDA. The kernel does `m` FMAs per
/// weight element on CUDA cores, so it slows as rows grow, while a small cuBLASLt product costs
/// about the same whatever its rows (host time: 41-57 µs a call through Burn's fusion on CubeCL's
/// stream, 55-70 µs under the stream handshake). Skinny vs cuBLASLt per call, bf16, H100
/// (`benches/RESULTS.md`, eleventh session, two calls; fourteenth session, same-stream cuBLASLt):
/// m ≤ 2 1.0-2.0× faster on every Llama layer; m = 4-8 0.96-2.2× up to 11008×4096 weights (1.8× on
/// 4096² against same-stream cuBLASLt) but 0.70-0.95× on the 4096×128256 output layer; m = 16
/// 1.2-1.7× on 4096×4096, 0.43-0.65× on the larger ones. Against Burn's matmul (other runtimes) it
/// is taken whenever it fits.
fn skinny_wins(p: &SkinnyProblem) -> bool {
    const MI: usize = 1 << 20;
    let weights = p.k * p.n;
    p.m <= 2 || (p.m <= 8 && weights <= 64 * MI) || weights <= 16 * MI
}

/// The same memory with axes 1 and 2 swapped (no copy).
fn swap_view<R: CubeRuntime>(t: &CubeTensor<R>) -> CubeTensor<R> {
    let mut view = t.clone();
    view.meta.swap(1, 2);
    view
}

/// `[batch, row]` element strides of a rank-3 operand as the skinny kernel steps them: 0 along an
/// axis of size 1 (a shared batch, a single row), whatever its stored stride.
fn batch_row_strides<R: CubeRuntime>(t: &CubeTensor<R>) -> [usize; 2] {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    [0, 1].map(|axis| if shape[axis] == 1 { 0 } else { strides[axis] })
}

/// The product on kiln's skinny kernel, if it has at most `MAX_ROWS` rows, a float dtype the
/// kernel accumulates in f32 without loss (f32, f16, bf16), a right operand with unit stride
/// along its columns (`[k, n]` weights as Burn stores them; a transposed `[n, k]` weight is
/// left to the tiled path), and `wanted` accepts it.
fn skinny<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    bias: Option<&CubeTensor<R>>,
    residual: Option<&CubeTensor<R>>,
    layout: GemmLayout,
    wanted: impl Fn(&SkinnyProblem) -> bool,
) -> Option<CubeTensor<R>> {
    if !matches!(lhs.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return None;
    }
    let rhs = if layout.transpose_rhs { swap_view(rhs) } else { rhs.clone() };
    let (k, n) = (rhs.meta.shape()[1], rhs.meta.shape()[2]);
    if n > 1 && rhs.meta.strides()[2] != 1 {
        return None;
    }
    let lhs = if layout.transpose_lhs { swap_view(lhs) } else { lhs.clone() };
    let out_shape = output_shape(&lhs.shape(), &rhs.shape(), GemmLayout::default())?;
    let problem = SkinnyProblem {
        batch: out_shape[0],
        m: out_shape[1],
        k,
        n,
        lhs_strides: batch_row_strides(&lhs),
        rhs_strides: batch_row_strides(&rhs),
        elem_size: lhs.dtype.size(),
        bias: bias.is_some(),
        residual: residual.is_some(),
    };
    if !problem.fits(&lhs.client) || !wanted(&problem) {
        return None;
    }
    // Few rows: a copy of a strided left operand is cheap next to reading `rhs`.
    let lhs = if k > 1 && lhs.meta.strides()[2] != 1 { dense(lhs) } else { lhs };
    let problem = SkinnyProblem { lhs_strides: batch_row_strides(&lhs), ..problem };
    let client = lhs.client.clone();
    let plan = problem.plan(&client);
    let dtype = storage(&lhs);
    let out = empty_like_device(&lhs, out_shape.clone(), lhs.dtype);
    // An absent bias or residual is bound to `rhs`: the kernels read them only under their flags.
    let extra = |t: Option<&CubeTensor<R>>| t.map_or_else(|| rhs.clone(), |t| dense(t.clone())).into_array_arg();
    let (lhs_arg, rhs_arg) = (lhs.into_array_arg(), rhs.clone().into_array_arg());
    if plan.splits == 1 {
        launch_skinny(&client, [dtype; 2], &problem, &plan, lhs_arg, rhs_arg, extra(bias), extra(residual), out.clone().into_array_arg());
    } else {
        let partials = empty_like_device(&out, [plan.splits * out_shape.num_elements()], DType::F32);
        let f32_type = storage(&partials);
        launch_skinny(&client, [dtype, f32_type], &problem, &plan, lhs_arg, rhs_arg, extra(None), extra(None), partials.clone().into_array_arg());
        launch_skinny_combine(&client, dtype, &problem, &plan, partials.into_array_arg(), extra(bias), extra(residual), out.clone().into_array_arg());
    }
    Some(out)
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::gemm_i8;

#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::TensorMetadata;
    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};

    use super::super::{GemmLayout, cublaslt, output_shape};
    use super::swap_view;
    use crate::backend::cube::{dense, empty_like_device};

    /// An operand cuBLASLt can read in place: unit stride on the last axis, or a transposed view
    /// (unit stride on the middle axis), which is read as its swap with the transpose flag flipped.
    fn readable<R: CubeRuntime>(t: &CubeTensor<R>, transpose: bool) -> (CubeTensor<R>, bool) {
        let (shape, strides) = (t.meta.shape(), t.meta.strides());
        let unit_or_single = |axis: usize| strides[axis] == 1 || shape[axis] == 1;
        if unit_or_single(2) && (strides[1] >= shape[2] || shape[1] == 1) {
            (t.clone(), transpose)
        } else if unit_or_single(1) && strides[2] >= shape[1] && shape[1] > 1 {
            (swap_view(t), !transpose)
        } else {
            (dense(t.clone()), transpose)
        }
    }

    /// The product on cuBLASLt, wherever it can run; where it cannot, the residual comes back
    /// (`Err`) for the caller's path. On the H100 (bf16, Llama shapes, `benches/RESULTS.md`
    /// 2026-11-23) it ran at 1.07-3.3× Burn's matmul from M = 512 up, so there is no crossover to
    /// Burn's matmul to keep.
    ///
    /// A residual nothing else holds becomes the output (cuBLASLt's `C = D`): a sum of products
    /// built up as each one's residual (the weight gradient of a chunked loss, `dW += xᵀ·dy`)
    /// then keeps one buffer instead of allocating, reading and writing a second each time.
    pub(super) fn gemm<R: CubeRuntime>(
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
        bias: Option<&CubeTensor<R>>,
        residual: Option<CubeTensor<R>>,
        layout: GemmLayout,
        scale: f32,
    ) -> Result<CubeTensor<R>, Option<CubeTensor<R>>> {
        let Some(index) = crate::backend::cube::cuda::device_index(lhs) else { return Err(residual) };
        let Some(out_shape) = output_shape(&lhs.shape(), &rhs.shape(), layout) else { return Err(residual) };
        let k = if layout.transpose_lhs { lhs.shape()[1] } else { lhs.shape()[2] };
        if out_shape.num_elements() == 0 || k == 0 {
            return Err(residual);
        }
        let (lhs, transpose_lhs) = readable(lhs, layout.transpose_lhs);
        let (rhs, transpose_rhs) = readable(rhs, layout.transpose_rhs);
        let bias = bias.map(|b| dense(b.clone()));
        let in_place = residual.as_ref().is_some_and(|r| r.can_mut() && r.is_contiguous() && r.dtype == lhs.dtype && r.shape() == out_shape);
        let (residual, out) = match residual {
            Some(r) if in_place => (Some(r.clone()), r), // one buffer, cuBLASLt's C and D
            residual => (residual.map(dense), empty_like_device(&lhs, out_shape, lhs.dtype)),
        };
        let args = cublaslt::GemmArgs {
            lhs: &lhs,
            rhs: &rhs,
            bias: bias.as_ref(),
            residual: residual.as_ref(),
            out: &out,
            layout: GemmLayout::new(transpose_lhs, transpose_rhs),
            scale,
        };
        match cublaslt::gemm(&args, index) {
            Ok(true) => Ok(out),
            Ok(false) => Err(residual),
            Err(e) => panic!("kiln::matmul: cuBLASLt failed for lhs {:?} rhs {:?} ({:?}): {e}", lhs.shape().as_slice(), rhs.shape().as_slice(), lhs.dtype),
        }
    }

    /// `out [m, n] (i32) = lhs [m, k] · rhs [n, k]ᵀ` for dense row-major i8 operands, on cuBLASLt's
    /// integer tensor-core kernels (the `TN` layout they need); `false` where cuBLASLt cannot run
    /// it (nothing enqueued).
    pub(crate) fn gemm_i8<R: CubeRuntime>(lhs: &CubeTensor<R>, rhs: &CubeTensor<R>, out: &CubeTensor<R>) -> bool {
        let Some(index) = crate::backend::cube::cuda::device_index(lhs) else { return false };
        let args = cublaslt::GemmArgs { lhs, rhs, bias: None, residual: None, out, layout: GemmLayout::new(false, true), scale: 1.0 };
        match cublaslt::gemm(&args, index) {
            Ok(ran) => ran,
            Err(e) => panic!("kiln::ternary_matmul: cuBLASLt's i8 product failed for {:?} · {:?}ᵀ: {e}", lhs.shape().as_slice(), rhs.shape().as_slice()),
        }
    }
}
