//! LoRA on CubeCL backends: the products through the backend's GEMM (the trait's defaults), the
//! dropout as one elementwise kernel, and on CUDA the backward's pair of products that read `dy`
//! as one kernel (`kiln_kernels::lora::dy`) and, with a dropout, its `dx = dropout(dh · A) +
//! prior` as one pass (`kiln_kernels::lora::expand`).

use burn::tensor::{Shape, TensorMetadata, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use kiln_kernels::{lora::launch_dropout, row::vector_size_for};

use super::{DropoutMask, ExpandSpec, LoraBackend, products};
use crate::backend::cube::{dense, empty_like_device, storage};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> LoraBackend for CubeBackend<R, F, I, BT> {
    fn lora_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        // Row-major element order is what the mask hashes, so strided views are made dense first.
        let x = dense(x);
        let len = x.shape().num_elements();
        let vector_size = vector_size_for(&x.client, len, x.dtype.size(), 16);
        let out = empty_like_device(&x, x.shape(), x.dtype);
        launch_dropout(&x.client.clone(), storage(&x), len, vector_size, mask, x.into_array_arg(), out.clone().into_array_arg());
        out
    }

    fn lora_dy_products(dy: FloatTensor<Self>, h: FloatTensor<Self>, b: FloatTensor<Self>, scale: f32) -> (FloatTensor<Self>, FloatTensor<Self>) {
        #[cfg(feature = "cuda")]
        if let Some(fused) = fused::takes(&dy, &h, &b) {
            return fused::dy_products(fused, dy, h, b, scale);
        }
        products::dy_products::<Self>(products::backend_gemm::<Self>, dy, h, b, scale)
    }

    fn lora_expand(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, residual: Option<FloatTensor<Self>>, spec: ExpandSpec, out: Shape) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(fused) = fused::expand_takes(&lhs, &rhs, residual.as_ref(), &spec, &out) {
            return fused::expand(fused, lhs, rhs, residual, spec, out);
        }
        products::expand::<Self>(products::backend_gemm::<Self>, Self::lora_dropout, lhs, rhs, residual, spec, out)
    }
}

/// The `dy` pair and the one-pass `dx` on CUDA's tensor cores.
#[cfg(feature = "cuda")]
mod fused {
    use burn::tensor::{DType, Shape, TensorMetadata};
    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
    use kiln_kernels::cuda_source::FloatKind;
    use kiln_kernels::lora::dy::{self, DyArgs, DyPlan, launch_dy_products};
    use kiln_kernels::lora::expand::{self, ExpandArgs, ExpandPlan, launch_expand};

    use super::ExpandSpec;

    use crate::backend::cube::cuda::{self, binding};
    use crate::backend::cube::{dense, empty_like_device};

    /// The element kind and the plan, if the kernel takes the pair: f16 or bf16 on a CUDA device
    /// of compute capability 8.0 or up, sizes [`DyPlan::new`] takes, and the kernel [`dy::enabled`].
    pub(super) fn takes<R: CubeRuntime>(dy: &CubeTensor<R>, h: &CubeTensor<R>, b: &CubeTensor<R>) -> Option<(FloatKind, DyPlan)> {
        let kind = cuda::float_kind(dy.dtype)?;
        if !dy::enabled() || h.dtype != dy.dtype || b.dtype != dy.dtype || !cuda::capable(dy, (8, 0)) {
            return None;
        }
        let hardware = &cuda::client(dy)?.properties().hardware;
        let sms = hardware.num_streaming_multiprocessors.unwrap_or(1) as usize;
        let (tokens, r, out) = (h.shape()[0], h.shape()[1], b.shape()[0]);
        DyPlan::new(kind, tokens, out, r, sms, hardware.max_shared_memory_size).map(|plan| (kind, plan))
    }

    /// A dense buffer the kernel may read in 16-byte pieces: fresh buffers are aligned; a view
    /// into one at another offset is copied.
    fn aligned<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
        let t = dense(t);
        if t.handle.offset_start.unwrap_or(0).is_multiple_of(16) { t } else { t.copy() }
    }

    /// `(s · dy · B, s · dyᵀ · h)` by the fused kernel (`takes` said yes).
    pub(super) fn dy_products<R: CubeRuntime>((kind, plan): (FloatKind, DyPlan), dy: CubeTensor<R>, h: CubeTensor<R>, b: CubeTensor<R>, scale: f32) -> (CubeTensor<R>, CubeTensor<R>) {
        let (dy, h, b) = (aligned(dy), aligned(h), aligned(b));
        let client = cuda::client(&dy).expect("`takes` checked the runtime");
        let (tokens, r, out) = (h.shape()[0], h.shape()[1], b.shape()[0]);
        let (dh_partials, db_partials) = plan.partials(tokens, out, r);
        let part_dh = empty_like_device(&dy, [dh_partials], DType::F32);
        let part_db = empty_like_device(&dy, [db_partials], DType::F32);
        let dh = empty_like_device(&dy, [tokens, r], dy.dtype);
        let db = empty_like_device(&dy, [out, r], dy.dtype);
        let args = DyArgs { dy: binding(&dy), b: binding(&b), h: binding(&h), part_dh: binding(&part_dh), part_db: binding(&part_db), dh: binding(&dh), db: binding(&db) };
        launch_dy_products(client, kind, plan, tokens, out, r, scale, args);
        (dh, db)
    }

    /// The element kind and the plan, if the expanding kernel takes the product: the backward's
    /// `dx` with a dropout (`rhs` `A` `[r, in]`), where it replaces the product, the dropout
    /// kernel and the add; f16 or bf16 (the right operand's and residual's dtype the same) on a
    /// CUDA device of compute capability 8.0 or up, sizes [`ExpandPlan::new`] takes, and the
    /// kernel [`expand::enabled`]. Without a dropout cuBLASLt's one product (the prior its `C`)
    /// measured as fast or faster in whole steps, and the forward's `y` slower (`expand.cu`).
    pub(super) fn expand_takes<R: CubeRuntime>(lhs: &CubeTensor<R>, rhs: &CubeTensor<R>, residual: Option<&CubeTensor<R>>, spec: &ExpandSpec, out: &Shape) -> Option<(FloatKind, ExpandPlan)> {
        let kind = cuda::float_kind(lhs.dtype)?;
        if !expand::enabled() || spec.rhs_transposed || spec.dropout.is_none() || rhs.dtype != lhs.dtype || residual.is_some_and(|c| c.dtype != lhs.dtype) || !cuda::capable(lhs, (8, 0)) {
            return None;
        }
        let sms = cuda::client(lhs)?.properties().hardware.num_streaming_multiprocessors.unwrap_or(1) as usize;
        let (n, [rows, r]) = (out[out.num_dims() - 1], lhs.shape().dims());
        ExpandPlan::new(kind, rows, n, r, sms).map(|plan| (kind, plan))
    }

    /// `dropout(s · lhs · rhs) + residual` by the expanding kernel (`expand_takes` said yes).
    pub(super) fn expand<R: CubeRuntime>(
        (kind, plan): (FloatKind, ExpandPlan),
        lhs: CubeTensor<R>,
        rhs: CubeTensor<R>,
        residual: Option<CubeTensor<R>>,
        spec: ExpandSpec,
        out: Shape,
    ) -> CubeTensor<R> {
        let (lhs, rhs, residual) = (aligned(lhs), aligned(rhs), residual.map(aligned));
        let client = cuda::client(&lhs).expect("`expand_takes` checked the runtime");
        let (n, [rows, r]) = (out[out.num_dims() - 1], lhs.shape().dims());
        let result = empty_like_device(&lhs, out, lhs.dtype);
        let args = ExpandArgs { l: binding(&lhs), right: binding(&rhs), residual: residual.as_ref().map(binding), out: binding(&result) };
        launch_expand(client, kind, plan, [rows, n, r], spec.scale, spec.dropout, args);
        result
    }
}
