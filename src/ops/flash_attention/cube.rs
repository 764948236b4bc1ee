//! Flash attention on CubeCL backends: planning, allocation and the split-KV merge around
//! `kiln_kernels::flash_attention`.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata, ops::FloatTensor, ops::FloatTensorOps};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::flash_attention::{
    AttentionFeatures, AttentionPlan, AttentionShape, BackwardArgs, ForwardArgs, launch_backward, launch_combine,
    launch_forward, launch_row_dot,
};

use super::{AttentionOptions, AttentionOutput, FlashAttentionBackend, reference};
use crate::backend::cube::{dense, empty_like_device, storage};

fn problem<R: CubeRuntime>(q: &CubeTensor<R>, k: &CubeTensor<R>) -> AttentionShape {
    let (qs, ks) = (q.shape(), k.shape());
    AttentionShape { batch: qs[0], q_heads: qs[1], kv_heads: ks[1], q_len: qs[2], kv_len: ks[2], head_dim: qs[3] }
}

fn features(options: &AttentionOptions, bias: bool) -> AttentionFeatures {
    AttentionFeatures {
        causal: options.causal,
        window: options.window,
        softcap: options.softcap.map(|c| c as f32),
        bias,
    }
}

fn plan<R: CubeRuntime>(q: &CubeTensor<R>, shape: AttentionShape, features: AttentionFeatures) -> AttentionPlan {
    AttentionPlan::new(&q.client, shape, features, storage(q)).unwrap_or_else(|e| {
        panic!("kiln::flash_attention: head_dim {} needs more than the device's {} bytes of shared memory per cube", e.head_dim, e.shared_bytes)
    })
}

/// Whether the tensor-core kernels can copy the rows of `t` 16 bytes at a time: unit last
/// stride, strides of the other (non-unit) dims multiples of 8 elements, a 16-byte aligned start.
pub(super) fn rows_copyable<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    let aligned = |i: usize| shape[i] == 1 || (strides[i] * t.dtype.size()).is_multiple_of(16);
    strides[3] == 1 && (0..3).all(aligned) && t.handle.offset_start.unwrap_or(0).is_multiple_of(16)
}

/// An input as the tensor-core kernels read it (a contiguous copy when the view is not).
pub(super) fn copyable<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    if rows_copyable(&t) { t } else { burn_cubecl::kernel::into_contiguous(t) }
}

/// The bias binding when there is none: `q` itself. The kernels read the bias only under the
/// compile-time `bias` feature, so nothing is allocated or filled for it (a fresh placeholder
/// was one more CubeCL launch per call, ~8 µs of host time on the H100 machine).
fn absent_bias<R: CubeRuntime>(q: &CubeTensor<R>) -> CubeTensor<R> {
    q.clone()
}

/// Nothing to launch for empty problems; the grid's y/z dimensions hold heads and batch.
fn launchable(shape: &AttentionShape) -> bool {
    let sizes = [shape.batch, shape.q_heads, shape.q_len, shape.kv_len, shape.head_dim];
    sizes.iter().all(|&s| s > 0) && shape.kv_heads < 1 << 16 && shape.batch < 1 << 16
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FlashAttentionBackend for CubeBackend<R, F, I, BT> {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: AttentionOptions,
    ) -> AttentionOutput<Self> {
        let shape = problem(&q, &k);
        if !launchable(&shape) {
            return reference::forward::<Self>(q, k, v, bias, options);
        }
        let features = features(&options, bias.is_some());
        let mut plan = plan(&q, shape, features);
        let (k, v) = if plan.tensor_cores { (copyable(k), copyable(v)) } else { (k, v) };
        plan.tensor_cores &= rows_copyable(&k) && rows_copyable(&v);
        #[cfg(feature = "cuda")]
        if bias.is_none()
            && plan.tensor_cores
            && let Some((output, lse)) = super::wgmma::forward(&q, &k, &v, shape, &options, plan.splits)
        {
            return AttentionOutput { output, lse };
        }
        let client = q.client.clone();
        let dtype = storage(&q);
        let stats = [shape.batch, shape.q_heads, shape.q_len];
        let output = empty_like_device(&q, q.shape(), q.dtype);
        let lse = empty_like_device(&q, stats, DType::F32);
        let bias = bias.unwrap_or_else(|| absent_bias(&q));
        let scale = options.scale_for(shape.head_dim) as f32;
        // With a split KV length the kernel writes f32 partials that the combine step merges.
        let rows = stats.iter().product::<usize>();
        let partials = (plan.splits > 1).then(|| {
            let out = empty_like_device(&q, [plan.splits, rows, shape.head_dim], DType::F32);
            (out, empty_like_device(&q, [plan.splits, rows], DType::F32))
        });
        let (target_out, target_lse, target_dtype) = match &partials {
            Some((out, lse)) => (out.clone(), lse.clone(), DType::F32.into()),
            None => (output.clone(), lse.clone(), dtype),
        };
        let args = ForwardArgs {
            q: q.into_tensor_arg(),
            k: k.into_tensor_arg(),
            v: v.into_tensor_arg(),
            bias: bias.into_tensor_arg(),
            out: target_out.into_tensor_arg(),
            lse: target_lse.into_tensor_arg(),
        };
        launch_forward(&client, &plan, shape, features, scale, dtype, target_dtype, args);
        if let Some((partial_out, partial_lse)) = partials {
            launch_combine(
                &client,
                dtype,
                plan.splits,
                rows,
                shape.head_dim,
                partial_out.into_array_arg(),
                partial_lse.into_array_arg(),
                output.clone().into_array_arg(),
                lse.clone().into_array_arg(),
            );
        }
        AttentionOutput { output, lse }
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_output: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let shape = problem(&q, &k);
        if !launchable(&shape) {
            return reference::backward::<Self>(q, k, v, bias, output, lse, d_output, options);
        }
        let features = features(&options, bias.is_some());
        let mut plan = plan(&q, shape, features);
        let [q, k, v, d_output] = if plan.tensor_cores { [q, k, v, d_output].map(copyable) } else { [q, k, v, d_output] };
        plan.tensor_cores &= [&q, &k, &v, &d_output].into_iter().all(rows_copyable);
        let client = q.client.clone();
        let dtype = storage(&q);
        let delta = row_dot(d_output.clone(), output);
        // The tensor-core backward adds dQ into a zeroed f32 accumulator (cast afterwards); the
        // portable one writes it in the input dtype. The accumulator is rank 1: the kernel
        // indexes it densely, and CUDA may pad the rows of a fresh rank-4 tensor.
        let dq = if plan.tensor_cores {
            Self::float_zeros(Shape::new([q.shape().num_elements()]), &q.device, FloatDType::F32)
        } else {
            empty_like_device(&q, q.shape(), q.dtype)
        };
        #[cfg(feature = "cuda")]
        if bias.is_none()
            && plan.tensor_cores
            && let Some((dk, dv)) = super::wgmma::backward(
                super::wgmma::BackwardInputs { q: &q, k: &k, v: &v, d_out: &d_output, lse: &lse, delta: &delta, dq: &dq },
                shape,
                &options,
            )
        {
            return (query_grad::<Self>(dq, &q), dk, dv);
        }
        let dk = empty_like_device(&k, k.shape(), k.dtype);
        let dv = empty_like_device(&v, v.shape(), v.dtype);
        let bias = bias.unwrap_or_else(|| absent_bias(&q));
        let args = || BackwardArgs {
            q: q.clone().into_tensor_arg(),
            k: k.clone().into_tensor_arg(),
            v: v.clone().into_tensor_arg(),
            bias: bias.clone().into_tensor_arg(),
            d_out: d_output.clone().into_tensor_arg(),
            lse: lse.clone().into_tensor_arg(),
            delta: delta.clone().into_tensor_arg(),
        };
        let scale = options.scale_for(shape.head_dim) as f32;
        launch_backward(
            &client,
            &plan,
            shape,
            features,
            scale,
            dtype,
            args(),
            args(),
            dq.clone().into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
        );
        let dq = if plan.tensor_cores { query_grad::<Self>(dq, &q) } else { dq };
        (dq, dk, dv)
    }
}

/// dQ from the tensor-core backwards' f32 accumulator: cast to q's dtype, in q's shape.
fn query_grad<B: Backend>(dq: FloatTensor<B>, q: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_reshape(B::float_cast(dq, FloatDType::from(q.dtype())), q.shape())
}

/// `Σ_d a · b` per row of two `[batch, heads, len, d]` tensors, in f32, dense `[batch, heads,
/// len]`. Operands with unit-stride rows are read at their strides (the Hopper forward's output
/// and the gradient that reaches it are `[batch, len, heads, d]` underneath); others are made
/// dense first.
fn row_dot<R: CubeRuntime>(a: CubeTensor<R>, b: CubeTensor<R>) -> CubeTensor<R> {
    let [a, b] = [a, b].map(|t| if t.meta.strides()[3] == 1 { t } else { dense(t) });
    let shape = a.shape();
    let delta = empty_like_device(&a, [shape[0], shape[1], shape[2]], DType::F32);
    let operand = |t: &CubeTensor<R>| {
        let s = t.meta.strides();
        (t.clone().into_array_arg(), [s[0], s[1], s[2]])
    };
    launch_row_dot(&a.client, storage(&a), [shape[0], shape[1], shape[2], shape[3]], operand(&a), operand(&b), delta.clone().into_array_arg())
        .unwrap_or_else(|e| panic!("kiln::flash_attention backward: head_dim {} is wider than the row kernel's {}", e.width, e.max));
    delta
}
