//! LoRA on CubeCL backends: the products through the backend's GEMM (the trait's defaults), the
//! dropout as one elementwise kernel, and on CUDA the backward's pair of products that read `dy`
//! as one kernel (`kiln_kernels::lora::dy`) and, with a dropout, its `dx = dropout(dh · A) +
//! prior` as one pass (`kiln_kernels::lora::expand`); on Hopper a float base's layer runs its
//! product and the update as one GEMM (`kiln_kernels::lora::linear`), forward and input gradient,
//! and so does a 4-bit base's wherever its product would dequantize the weight anyway.

#[cfg(feature = "cuda")]
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{Shape, TensorMetadata, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use kiln_kernels::{lora::launch_dropout, row::vector_size_for};

use super::products::{self, Kernels};
use super::{DropoutMask, ExpandSpec, LoraBackend, LoraLinearGrads, LoraSpec};
use crate::backend::cube::{dense, empty_like_device, storage};
use crate::ops::matmul::MatmulBackend;
#[cfg(feature = "cuda")]
use crate::ops::nf4::Nf4Backend;
use crate::ops::nf4::Quantized4Primitive;

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

    fn lora_dy_products(dy: FloatTensor<Self>, h: FloatTensor<Self>, b: FloatTensor<Self>, scales: [f32; 2]) -> (FloatTensor<Self>, FloatTensor<Self>) {
        #[cfg(feature = "cuda")]
        if let Some(fused) = fused::takes(&dy, &h, &b) {
            return fused::dy_products(fused, dy, h, b, scales);
        }
        products::dy_products::<Self>(Self::gemm, dy, h, b, scales)
    }

    fn lora_expand(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, residual: Option<FloatTensor<Self>>, spec: ExpandSpec, out: Shape) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(fused) = fused::expand_takes(&lhs, &rhs, residual.as_ref(), &spec, &out) {
            return fused::expand(fused, lhs, rhs, residual, spec, out);
        }
        products::expand::<Self>(Self::gemm, Self::lora_dropout, lhs, rhs, residual, spec, out)
    }

    fn lora_linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        #[cfg(feature = "cuda")]
        if let Some(fit) = fused::linear_takes(&x, &w, &b, bias.as_ref(), fused::Pass::Forward) {
            return fused_forward::<R, F, I, BT>(fit, x, w, bias, a, b, spec);
        }
        products::linear_forward(&Kernels::<Self>::backend(), x, w, bias, a, b, spec)
    }

    fn lora_linear_4bit_forward(
        x: FloatTensor<Self>,
        w: Quantized4Primitive<Self>,
        bias: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Where the 4-bit product would go through a dequantized temporary anyway, the one-GEMM
        // kernel reads that temporary, the update in the same product.
        #[cfg(feature = "cuda")]
        if let Some(fit) = fused::linear_4bit_takes(&x, w.layout, &b, bias.as_ref(), fused::Pass::Forward) {
            let dense = Self::float_transpose(Self::dequantize_4bit(w, x.dtype));
            return fused_forward::<R, F, I, BT>(fit, x, dense, bias, a, b, spec);
        }
        products::linear_4bit_forward(&Kernels::<Self>::backend(), x, w, bias, a, b, spec)
    }

    fn lora_linear_4bit_backward(
        x: FloatTensor<Self>,
        hs: FloatTensor<Self>,
        w: Quantized4Primitive<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: LoraSpec,
        prior: Option<FloatTensor<Self>>,
        want_dx: bool,
    ) -> LoraLinearGrads<FloatTensor<Self>> {
        // The 4-bit input gradient dequantizes the weight whatever the rows: the one-GEMM kernel
        // reads that temporary instead where it takes `dx` (no dropout, as over a float base).
        #[cfg(feature = "cuda")]
        if want_dx && spec.dropout.is_none() {
            if let Some(fit) = fused::linear_4bit_takes(&dy, w.layout, &a, prior.as_ref(), fused::Pass::InputGrad) {
                let dense = Self::float_transpose(Self::dequantize_4bit(w, dy.dtype));
                return fused_backward::<R, F, I, BT>(fit, x, hs, dense, a, b, dy, spec, prior);
            }
        }
        products::linear_4bit_backward(&Kernels::<Self>::backend(), x, hs, w, a, b, dy, spec, prior, want_dx)
    }

    fn lora_linear_backward(
        x: FloatTensor<Self>,
        hs: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: LoraSpec,
        prior: Option<FloatTensor<Self>>,
        want_dx: bool,
    ) -> LoraLinearGrads<FloatTensor<Self>> {
        // A dropout on the update's share of `dx` keeps it composed (the mask is elementwise on
        // that share alone); a prior is the kernel's residual.
        #[cfg(feature = "cuda")]
        if want_dx && spec.dropout.is_none() {
            if let Some(fit) = fused::linear_takes(&dy, &w, &a, prior.as_ref(), fused::Pass::InputGrad) {
                return fused_backward::<R, F, I, BT>(fit, x, hs, w, a, b, dy, spec, prior);
            }
        }
        products::linear_backward(&Kernels::<Self>::backend(), x, hs, w, a, b, dy, spec, prior, want_dx)
    }
}

/// `(y, hs)` of a LoRA layer with `y` by the fused layer kernel (`fit`, for the forward over the
/// `[in, out]` weight `w`): the scaled factor `hs`, then `x · W + hs · Bᵀ + bias`.
#[cfg(feature = "cuda")]
fn fused_forward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    fit: fused::LinearFit,
    x: FloatTensor<CubeBackend<R, F, I, BT>>,
    w: FloatTensor<CubeBackend<R, F, I, BT>>,
    bias: Option<FloatTensor<CubeBackend<R, F, I, BT>>>,
    a: FloatTensor<CubeBackend<R, F, I, BT>>,
    b: FloatTensor<CubeBackend<R, F, I, BT>>,
    spec: LoraSpec,
) -> (FloatTensor<CubeBackend<R, F, I, BT>>, FloatTensor<CubeBackend<R, F, I, BT>>) {
    let hs = products::scaled_factor(&Kernels::<CubeBackend<R, F, I, BT>>::backend(), x.clone(), a, &spec);
    let y = fused::linear(fit, x, w, hs.clone(), b, bias, None);
    (y, hs)
}

/// A LoRA layer's gradients with `dx = dy · Wᵀ + dh · A + prior` by the fused layer kernel (`fit`,
/// for the input gradient over the `[in, out]` weight `w`), after the rank-r products.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn fused_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    fit: fused::LinearFit,
    x: FloatTensor<CubeBackend<R, F, I, BT>>,
    hs: FloatTensor<CubeBackend<R, F, I, BT>>,
    w: FloatTensor<CubeBackend<R, F, I, BT>>,
    a: FloatTensor<CubeBackend<R, F, I, BT>>,
    b: FloatTensor<CubeBackend<R, F, I, BT>>,
    dy: FloatTensor<CubeBackend<R, F, I, BT>>,
    spec: LoraSpec,
    prior: Option<FloatTensor<CubeBackend<R, F, I, BT>>>,
) -> LoraLinearGrads<FloatTensor<CubeBackend<R, F, I, BT>>> {
    let [dh, da, db] = products::rank_grads(&Kernels::<CubeBackend<R, F, I, BT>>::backend(), x, hs, b, dy.clone(), &spec, 1.0);
    let dx = fused::linear(fit, dy, w, dh, a, None, prior);
    LoraLinearGrads { x: Some(dx), a: da, b: db }
}

/// The `dy` pair and the one-pass `dx` on CUDA's tensor cores.
#[cfg(feature = "cuda")]
mod fused {
    use burn::tensor::{DType, Shape, TensorMetadata};
    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
    use kiln_kernels::cuda_source::FloatKind;
    use kiln_kernels::lora::dy::{self, DyArgs, DyPlan, launch_dy_products};
    use kiln_kernels::lora::expand::{self, ExpandArgs, ExpandPlan, launch_expand};
    use kiln_kernels::lora::linear::{self as fused_linear, LinearArgs, Major, launch_linear};

    use super::ExpandSpec;
    use crate::ops::nf4::{Layout4, reads_packed};

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
    pub(super) fn dy_products<R: CubeRuntime>((kind, plan): (FloatKind, DyPlan), dy: CubeTensor<R>, h: CubeTensor<R>, b: CubeTensor<R>, scales: [f32; 2]) -> (CubeTensor<R>, CubeTensor<R>) {
        let (dy, h, b) = (aligned(dy), aligned(h), aligned(b));
        let client = cuda::client(&dy).expect("`takes` checked the runtime");
        let (tokens, r, out) = (h.shape()[0], h.shape()[1], b.shape()[0]);
        let (dh_partials, db_partials) = plan.partials(tokens, out, r);
        let part_dh = empty_like_device(&dy, [dh_partials], DType::F32);
        let part_db = empty_like_device(&dy, [db_partials], DType::F32);
        let dh = empty_like_device(&dy, [tokens, r], dy.dtype);
        let db = empty_like_device(&dy, [out, r], dy.dtype);
        let args = DyArgs { dy: binding(&dy), b: binding(&b), h: binding(&h), part_dh: binding(&part_dh), part_db: binding(&part_db), dh: binding(&dh), db: binding(&db) };
        launch_dy_products(client, kind, plan, tokens, out, r, scales, args);
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

    /// Which product of a float base's LoRA layer the kernel runs: the forward `x · W + hs · Bᵀ`
    /// or the input gradient `dy · Wᵀ + dh · A`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Pass {
        Forward,
        InputGrad,
    }

    /// What a launch of the fused layer kernel needs: the element kind, how its W and R are
    /// stored, and `[m, n, k, r]`.
    pub(super) struct LinearFit {
        kind: FloatKind,
        majors: [Major; 2],
        shape: [usize; 4],
    }

    /// The launch, if the fused layer kernel takes `pass` over a 4-bit `layout` dequantized in
    /// `lhs`'s dtype (a fresh `[out, in]` buffer, read as its transposed view), as
    /// [`linear_takes`] says for a float weight; the forward only where the backend's 4-bit
    /// product would dequantize too (not the GEMV's or the Hopper 4-bit GEMM's rows).
    pub(super) fn linear_4bit_takes<R: CubeRuntime>(lhs: &CubeTensor<R>, layout: Layout4, right: &CubeTensor<R>, extra: Option<&CubeTensor<R>>, pass: Pass) -> Option<LinearFit> {
        let rows = lhs.shape().num_elements() / lhs.shape()[lhs.shape().num_dims() - 1].max(1);
        if pass == Pass::Forward && reads_packed(lhs, rows, layout) {
            return None;
        }
        linear_fit(lhs, [layout.k, layout.n], false, right, extra, pass)
    }

    /// Whether the base's `[in, out]` weight is stored as given (`[in, out]` row-major), else as
    /// a transposed view of a row-major `[out, in]` buffer; `None` for any other layout.
    fn stored_in_out<R: CubeRuntime>(w: &CubeTensor<R>) -> Option<bool> {
        let ([d_in, d_out], strides) = (w.shape().dims(), w.meta.strides());
        if strides[1] == 1 && (strides[0] == d_out || d_in == 1) {
            Some(true)
        } else if strides[0] == 1 && (strides[1] == d_in || d_out == 1) {
            Some(false)
        } else {
            None
        }
    }

    /// The launch, if the fused layer kernel takes `pass` with `lhs` (`x` or `dy`), the base's
    /// weight `w`, the update's right factor `right` (`B` `[out, r]` forward, `A` `[r, in]`
    /// backward) and `extra` (the bias forward, the prior backward): one f16/bf16 dtype, a device
    /// of compute capability 9.0 (the kernel is `sm_90a`), `w` read in place (stored either way
    /// round, 16-byte aligned) and sizes the kernel [`fused_linear::serves`].
    pub(super) fn linear_takes<R: CubeRuntime>(lhs: &CubeTensor<R>, w: &CubeTensor<R>, right: &CubeTensor<R>, extra: Option<&CubeTensor<R>>, pass: Pass) -> Option<LinearFit> {
        if w.dtype != lhs.dtype || !w.handle.offset_start.unwrap_or(0).is_multiple_of(16) {
            return None;
        }
        linear_fit(lhs, w.shape().dims(), stored_in_out(w)?, right, extra, pass)
    }

    /// [`linear_takes`] for a weight `[d_in, d_out]` in `lhs`'s dtype, 16-byte aligned, stored
    /// `[in, out]` row-major (`in_out`) or as a transposed view of a row-major `[out, in]` buffer.
    fn linear_fit<R: CubeRuntime>(lhs: &CubeTensor<R>, [d_in, d_out]: [usize; 2], in_out: bool, right: &CubeTensor<R>, extra: Option<&CubeTensor<R>>, pass: Pass) -> Option<LinearFit> {
        let kind = cuda::float_kind(lhs.dtype)?;
        let same = [right].into_iter().chain(extra).all(|t| t.dtype == lhs.dtype);
        if !same || cuda::compute_capability(cuda::device_index(lhs)?)? != (9, 0) {
            return None;
        }
        let sms = cuda::client(lhs)?.properties().hardware.num_streaming_multiprocessors.unwrap_or(1) as usize;
        let width = lhs.shape()[lhs.shape().num_dims() - 1];
        let r = if pass == Pass::Forward { right.shape()[1] } else { right.shape()[0] };
        let rows = lhs.shape().num_elements() / width.max(1);
        // The forward reads W `[k, n]` = `[in, out]`; the input gradient W `[n, k]` = `[in, out]`,
        // and the update's R is B `[n, r]` forward, A `[r, n]` backward.
        let (n, k, w_major, r_major) = match pass {
            Pass::Forward => (d_out, d_in, if in_out { Major::N } else { Major::K }, Major::K),
            Pass::InputGrad => (d_in, d_out, if in_out { Major::K } else { Major::N }, Major::N),
        };
        let shape = [rows, n, k, r];
        fused_linear::serves(kind, shape, sms).then_some(LinearFit { kind, majors: [w_major, r_major], shape })
    }

    /// `lhs · W + l · Rᵀ + bias + residual` by the fused layer kernel (`linear_takes` said yes), in
    /// `lhs`'s shape with its last axis `n`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear<R: CubeRuntime>(
        fit: LinearFit,
        lhs: CubeTensor<R>,
        w: CubeTensor<R>,
        l: CubeTensor<R>,
        right: CubeTensor<R>,
        bias: Option<CubeTensor<R>>,
        residual: Option<CubeTensor<R>>,
    ) -> CubeTensor<R> {
        let (lhs, l, right, bias, residual) = (aligned(lhs), aligned(l), aligned(right), bias.map(aligned), residual.map(aligned));
        let client = cuda::client(&lhs).expect("`linear_takes` checked the runtime");
        let out_shape = super::products::with_last(lhs.shape(), fit.shape[1]);
        let out = empty_like_device(&lhs, out_shape, lhs.dtype);
        let args = LinearArgs {
            x: binding(&lhs),
            w: binding(&w),
            l: binding(&l),
            r: binding(&right),
            bias: bias.as_ref().map(binding),
            residual: residual.as_ref().map(binding),
            out: binding(&out),
        };
        launch_linear(client, fit.kind, fit.shape, fit.majors, args);
        out
    }
}
