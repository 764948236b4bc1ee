//! The Hopper forward (`kiln_kernels::flash_attention::wgmma`) behind `CubeBackend`'s forward:
//! which problems it takes, and its launch on CubeCL's CUDA client.
//!
//! `KILN_ATTENTION=mma` keeps every forward on the CubeCL `mma.sync` kernel (for comparisons).

use std::sync::OnceLock;

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use kiln_kernels::flash_attention::AttentionShape;
use kiln_kernels::flash_attention::wgmma::{RowStrides, WgmmaArgs, WgmmaForward, launch_forward};

use super::AttentionOptions;
use super::cube::{copyable, rows_copyable};
use crate::backend::cube::{cuda, empty_like_device};

fn disabled() -> bool {
    static DISABLED: OnceLock<bool> = OnceLock::new();
    *DISABLED.get_or_init(|| std::env::var("KILN_ATTENTION").is_ok_and(|v| v == "mma"))
}

/// The element strides of `t` as the kernel takes them, if they fit its 32-bit scalars.
fn row_strides<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<RowStrides> {
    let s = t.meta.strides();
    let narrow = |i: usize| u32::try_from(s[i]).ok();
    Some(RowStrides { batch: narrow(0)?, head: narrow(1)?, row: narrow(2)? })
}

/// The forward on warpgroup MMA, if this problem is one it serves: f16/bf16 on a compute
/// capability 9.0 device (its `sm_90a` code runs nowhere else), plain logits (no bias, softcap or
/// window, positive scale), one split, and rows it can copy 16 bytes at a time (`k` and `v`
/// already `copyable`; `q` made so here, once the device is known to qualify).
pub(super) fn forward<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    shape: AttentionShape,
    options: &AttentionOptions,
    splits: usize,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let f16 = match q.dtype {
        DType::F16 => true,
        DType::BF16 => false,
        _ => return None,
    };
    let scale = options.scale_for(shape.head_dim) as f32;
    let plain = options.softcap.is_none() && options.window.is_none() && scale > 0.0 && splits == 1;
    if disabled() || !plain || !WgmmaForward::supports(&shape) {
        return None;
    }
    let client = cuda::client(q)?;
    if cuda::compute_capability(cuda::device_index(q)?)? != (9, 0) {
        return None;
    }
    let q = &copyable(q.clone());
    if ![q, k, v].into_iter().all(rows_copyable) {
        return None;
    }
    let (qs, ks, vs) = (row_strides(q)?, row_strides(k)?, row_strides(v)?);
    let output = empty_like_device(q, q.shape(), q.dtype);
    let lse = empty_like_device(q, [shape.batch, shape.q_heads, shape.q_len], DType::F32);
    let binding = |t: &CubeTensor<R>| t.handle.clone().binding();
    let args = WgmmaArgs { q: (binding(q), qs), k: (binding(k), ks), v: (binding(v), vs), out: binding(&output), lse: binding(&lse) };
    launch_forward(client, WgmmaForward { head_dim: shape.head_dim, causal: options.causal, f16 }, shape, scale, args);
    Some((output, lse))
}
