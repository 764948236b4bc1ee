//! The Hopper kernels (`kiln_kernels::flash_attention::wgmma`) behind `CubeBackend`'s forward and
//! backward: which problems they take, and their launches on CubeCL's CUDA client.
//!
//! `KILN_ATTENTION=mma` keeps every problem on the CubeCL `mma.sync` kernels (for comparisons).

use std::sync::OnceLock;

use burn::tensor::DType;
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use kiln_kernels::flash_attention::AttentionShape;
use kiln_kernels::flash_attention::wgmma::{BackwardArgs, ForwardArgs, RowStrides, WgmmaVariant, launch_backward, launch_forward};

use super::AttentionOptions;
use super::cube::{copyable, rows_copyable};
use crate::backend::cube::cuda::{self, binding};
use crate::backend::cube::{dense, empty_like_device};

fn disabled() -> bool {
    static DISABLED: OnceLock<bool> = OnceLock::new();
    *DISABLED.get_or_init(|| std::env::var("KILN_ATTENTION").is_ok_and(|v| v == "mma"))
}

/// The element strides of `t` as the kernels take them, if they fit their 32-bit scalars.
fn row_strides<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<RowStrides> {
    let s = t.meta.strides();
    let narrow = |i: usize| u32::try_from(s[i]).ok();
    Some(RowStrides { batch: narrow(0)?, head: narrow(1)?, row: narrow(2)? })
}

/// A fresh `[batch, heads, len, d]` tensor like `like`, stored as `[batch, len, heads, d]`: the
/// layout a model's `swap_dims(1, 2)` and reshape to `[batch, len, heads · d]` read (and its
/// projections' gradients arrive in) without a copy. Dense outputs cost a Llama-3.2-1B QLoRA step
/// ~2.5 ms of copies on the H200 (`benches/RESULTS.md`, 54th session).
fn sequence_major<R: CubeRuntime>(like: &CubeTensor<R>, shape: [usize; 4]) -> CubeTensor<R> {
    let [batch, heads, len, d] = shape;
    let mut t = empty_like_device(like, [batch, len, heads, d], like.dtype);
    t.meta.swap(1, 2);
    t
}

/// The kernel variant for this problem, and the CUDA client to launch it on, if the Hopper
/// kernels serve it: f16/bf16 on a compute capability 9.0 device (their `sm_90a` code runs
/// nowhere else), plain logits (no bias, softcap or window, positive scale) and one split.
fn variant<'a, R: CubeRuntime>(
    q: &'a CubeTensor<R>,
    shape: AttentionShape,
    options: &AttentionOptions,
    splits: usize,
) -> Option<(&'a ComputeClient<CudaRuntime>, WgmmaVariant)> {
    let f16 = match q.dtype {
        DType::F16 => true,
        DType::BF16 => false,
        _ => return None,
    };
    let scale = options.scale_for(shape.head_dim);
    let plain = options.softcap.is_none() && options.window.is_none() && scale > 0.0 && splits == 1;
    if disabled() || !plain || !WgmmaVariant::supports(&shape) {
        return None;
    }
    let client = cuda::client(q)?;
    if cuda::compute_capability(cuda::device_index(q)?)? != (9, 0) {
        return None;
    }
    Some((client, WgmmaVariant { head_dim: shape.head_dim, causal: options.causal, f16 }))
}

/// The forward on warpgroup MMA, if this problem is one it serves ([`variant`]) with rows it can
/// copy 16 bytes at a time (`k` and `v` already `copyable`; `q` made so here, once the device is
/// known to qualify).
pub(super) fn forward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    shape: AttentionShape,
    options: &AttentionOptions,
    splits: usize,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let (client, variant) = variant(q, shape, options, splits)?;
    let q = &copyable(q.clone());
    if ![q, k, v].into_iter().all(rows_copyable) {
        return None;
    }
    let (qs, ks, vs) = (row_strides(q)?, row_strides(k)?, row_strides(v)?);
    let output = sequence_major(q, [shape.batch, shape.q_heads, shape.q_len, shape.head_dim]);
    let lse = empty_like_device(q, [shape.batch, shape.q_heads, shape.q_len], DType::F32);
    let out = (binding(&output), row_strides(&output)?);
    let args = ForwardArgs { q: (binding(q), qs), k: (binding(k), ks), v: (binding(v), vs), out, lse: binding(&lse) };
    launch_forward(client, variant, shape, options.scale_for(shape.head_dim) as f32, args);
    Some((output, lse))
}

/// Inputs of the backward as `CubeBackend` prepared them: q, k, v, d_out `copyable`; `delta`
/// (`Σ dO·O` per row) dense f32; `dq` a zeroed dense f32 accumulator in q's shape.
pub(super) struct BackwardInputs<'a, R: CubeRuntime> {
    pub q: &'a CubeTensor<R>,
    pub k: &'a CubeTensor<R>,
    pub v: &'a CubeTensor<R>,
    pub d_out: &'a CubeTensor<R>,
    pub lse: &'a CubeTensor<R>,
    pub delta: &'a CubeTensor<R>,
    pub dq: &'a CubeTensor<R>,
}

/// The backward on warpgroup MMA, if this problem is one it serves ([`variant`]): adds dQ into
/// `inputs.dq` and returns (dK, dV).
pub(super) fn backward<R: CubeRuntime>(
    inputs: BackwardInputs<'_, R>,
    shape: AttentionShape,
    options: &AttentionOptions,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let BackwardInputs { q, k, v, d_out, lse, delta, dq } = inputs;
    let (client, variant) = variant(q, shape, options, 1)?;
    let strides = [q, k, v, d_out].map(row_strides);
    let [Some(qs), Some(ks), Some(vs), Some(ds)] = strides else { return None };
    let lse = dense(lse.clone());
    let kv_shape = [shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim];
    let (dk, dv) = (sequence_major(k, kv_shape), sequence_major(k, kv_shape));
    let kv_grads = row_strides(&dk)?;
    let args = BackwardArgs {
        q: (binding(q), qs),
        k: (binding(k), ks),
        v: (binding(v), vs),
        d_out: (binding(d_out), ds),
        lse: binding(&lse),
        delta: binding(delta),
        dq: binding(dq),
        dk: binding(&dk),
        dv: binding(&dv),
        kv_grads,
    };
    launch_backward(client, variant, shape, options.scale_for(shape.head_dim) as f32, args);
    Some((dk, dv))
}
