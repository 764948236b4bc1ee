//! Dense products on CubeCL backends: cuBLASLt on CUDA, Burn's autotuned matmul otherwise (wgpu,
//! f64, cuBLASLt missing). `KILN_GEMM=burn` forces Burn's matmul (for measurements).

use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{GemmViews, MatmulBackend, reference, viewed};

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
        #[cfg(feature = "cuda")]
        let out = cuda::gemm(&lhs, &rhs, bias.as_ref(), residual.as_ref(), views.layout);
        #[cfg(not(feature = "cuda"))]
        let out = None;
        let out = out.unwrap_or_else(|| reference::product::<Self>(lhs, rhs, bias, residual, views.layout));
        Self::float_reshape(out, views.out)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::{Shape, TensorMetadata};
    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};

    use super::super::{GemmLayout, cublaslt, output_shape};
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

    /// The same memory with axes 1 and 2 swapped (no copy).
    fn swap_view<R: CubeRuntime>(t: &CubeTensor<R>) -> CubeTensor<R> {
        let mut view = t.clone();
        view.meta.swap(1, 2);
        view
    }

    /// The CUDA device index of a CubeCL tensor, if it lives on CUDA.
    fn cuda_index<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<usize> {
        (&t.device as &dyn std::any::Any).downcast_ref::<cubecl::cuda::CudaDevice>().map(|d| d.index)
    }

    /// Whether this product goes to cuBLASLt: wherever it can run, unless `KILN_GEMM=burn`. On the
    /// H100 (bf16, Llama shapes, `benches/RESULTS.md` 2026-11-23, device handshake) it ran at
    /// 1.07-3.3× Burn's matmul from M = 512 up; at M ≤ 16 both are bound by per-call host cost and
    /// came out 0.92-4.1× (two rows within their run-to-run spread), so there is no crossover to keep.
    fn wanted() -> bool {
        std::env::var("KILN_GEMM").as_deref() != Ok("burn")
    }

    pub(super) fn gemm<R: CubeRuntime>(
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
        bias: Option<&CubeTensor<R>>,
        residual: Option<&CubeTensor<R>>,
        layout: GemmLayout,
    ) -> Option<CubeTensor<R>> {
        let index = cuda_index(lhs)?;
        let out_shape: Shape = output_shape(&lhs.shape(), &rhs.shape(), layout)?;
        let k = if layout.transpose_lhs { lhs.shape()[1] } else { lhs.shape()[2] };
        if out_shape.num_elements() == 0 || k == 0 || !wanted() {
            return None;
        }
        let (lhs, transpose_lhs) = readable(lhs, layout.transpose_lhs);
        let (rhs, transpose_rhs) = readable(rhs, layout.transpose_rhs);
        let bias = bias.map(|b| dense(b.clone()));
        let residual = residual.map(|r| dense(r.clone()));
        let out = empty_like_device(&lhs, out_shape, lhs.dtype);
        let args = cublaslt::GemmArgs {
            lhs: &lhs,
            rhs: &rhs,
            bias: bias.as_ref(),
            residual: residual.as_ref(),
            out: &out,
            layout: GemmLayout::new(transpose_lhs, transpose_rhs),
        };
        match cublaslt::gemm(&args, index) {
            Ok(true) => Some(out),
            Ok(false) => None,
            Err(e) => panic!("kiln::matmul: cuBLASLt failed for lhs {:?} rhs {:?} ({:?}): {e}", lhs.shape().as_slice(), rhs.shape().as_slice(), lhs.dtype),
        }
    }
}
