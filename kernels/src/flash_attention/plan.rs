//! How an attention launch is cut ([`AttentionPlan`]): block sizes, KV splits for decoding, and
//! whether the tensor-core kernels ([`super::mma`]) run, from the shape, dtype and device.

use cubecl::ir::{ElemType, FloatKind, features::MmaConfig};
use cubecl::prelude::*;

use super::*;

/// How a launch is cut: the configuration plus, for the forward, the KV splits.
#[derive(Debug, Clone, Copy)]
pub struct AttentionPlan {
    pub config: AttentionConfig,
    /// Splits of the KV length (1: no split, the forward writes the final output).
    pub splits: usize,
    /// Keys per split (a multiple of `block_k`).
    pub split_len: usize,
    /// Run the forward and the backward on tensor cores ([`mma`]); otherwise the portable
    /// kernels.
    pub tensor_cores: bool,
    /// Planes (16 packed query rows each) per tensor-core forward cube.
    pub planes: usize,
    /// Planes (16 keys each) per tensor-core backward cube. Each key block adds its share of dQ
    /// with atomics, so wider blocks add less: 8 planes (128 keys) where the shared memory
    /// allows, which on the H100 ran the hd128 backward 5–11% faster than 4.
    pub backward_planes: usize,
}

/// Shapes of one attention problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
}

/// Masking and logit options, fixed per launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionFeatures {
    pub causal: bool,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    pub bias: bool,
}

/// Error for a head dimension whose tiles do not fit the device's shared memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadDimTooLarge {
    pub head_dim: usize,
    pub shared_bytes: usize,
}

pub(super) const LANES: usize = 8;
pub(super) const BLOCK_ROWS: usize = 16;

impl AttentionPlan {
    /// Plan the forward (and dQ) launch: the widest key tile whose shared memory fits, and KV
    /// splits when the packed rows alone give fewer cubes than the device has multiprocessors.
    ///
    /// The forward runs on tensor cores when the runtime offers `mma.sync` m16n8k16 for `dtype`
    /// and `cp.async` (f16/bf16 on CUDA sm_80+) and the head size is a multiple of 16 up to 128;
    /// its cubes hold up to four planes of 16 packed rows. `KILN_ATTENTION_PORTABLE=1` forces the
    /// portable kernels, `KILN_ATTENTION_PLANES=n` (1 to 16) `n` planes per tensor-core forward
    /// cube, `KILN_ATTENTION_BACKWARD_PLANES=n` per backward cube, and
    /// `KILN_ATTENTION_SPLITS=n` `n` KV splits (all for measurements).
    pub fn new<R: Runtime>(
        client: &ComputeClient<R>,
        shape: AttentionShape,
        features: AttentionFeatures,
        dtype: StorageType,
    ) -> Result<Self, HeadDimTooLarge> {
        let props = client.properties();
        let limit = props.hardware.max_shared_memory_size.min(48 * 1024);
        let base = AttentionConfig {
            head_dim: shape.head_dim,
            block_q: BLOCK_ROWS,
            block_k: 8,
            lanes: LANES,
            plane_size: plane_size_for_reduction(client),
            causal: features.causal,
            window: features.window.is_some(),
            softcap: features.softcap.is_some(),
            bias: features.bias,
            unroll: plane_size_for_reduction(client) > 0,
        };
        let config = [64, 32, 16, 8]
            .into_iter()
            .map(|block_k| AttentionConfig { block_k, ..base })
            .find(|c| c.forward_shared_bytes() <= limit && c.backward_kv_shared_bytes() <= limit)
            .ok_or(HeadDimTooLarge { head_dim: shape.head_dim, shared_bytes: limit })?;
        let group = shape.q_heads / shape.kv_heads.max(1);
        let packed = group * shape.q_len;
        let portable = std::env::var("KILN_ATTENTION_PORTABLE").is_ok_and(|v| v == "1");
        // Short packed rows (decoding) fill fewer planes; the KV splits fill the GPU instead.
        let planes = measurement_override("KILN_ATTENTION_PLANES", 1..=16).unwrap_or_else(|| packed.div_ceil(mma::PLANE_ROWS).clamp(1, 4));
        let backward_planes = measurement_override("KILN_ATTENTION_BACKWARD_PLANES", 1..=16).unwrap_or_else(|| {
            let wide = mma::shared_bytes(shape.head_dim, dtype.size(), 8) <= props.hardware.max_shared_memory_size;
            if wide { 8 } else { 4 }
        });
        let tensor_cores = !portable && tensor_cores(client, dtype, shape.head_dim, planes.max(backward_planes));
        let (rows, key_tile) = if tensor_cores { (planes * mma::PLANE_ROWS, mma::TILE) } else { (config.block_q, config.block_k) };
        let cubes = packed.div_ceil(rows) * shape.kv_heads * shape.batch;
        let sms = props.hardware.num_streaming_multiprocessors.unwrap_or(16) as usize;
        let tiles = shape.kv_len.div_ceil(key_tile).max(1);
        // Each split keeps at least four key tiles so the merge stays cheap next to the work.
        // `KILN_ATTENTION_SPLITS=n` forces `n` splits (for measurements).
        let splits = measurement_override("KILN_ATTENTION_SPLITS", 1..=usize::MAX).unwrap_or(if cubes >= sms { 1 } else { (2 * sms).div_ceil(cubes).min(tiles.div_ceil(4)).max(1) });
        let split_len = tiles.div_ceil(splits.min(tiles)) * key_tile;
        let splits = shape.kv_len.div_ceil(split_len.max(1)).max(1);
        Ok(Self { config, splits, split_len, tensor_cores, planes, backward_planes })
    }
}

/// Whether the tensor-core forward can run `dtype` heads of `head_dim` on `client`.
fn tensor_cores<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, head_dim: usize, planes: usize) -> bool {
    let props = client.properties();
    let half = matches!(dtype, StorageType::Scalar(ElemType::Float(FloatKind::F16 | FloatKind::BF16)));
    let f32_type = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let mma = MmaConfig { a_type: dtype, b_type: dtype, cd_type: f32_type, m: 16, n: 8, k: 16 };
    let warps_of_32 = props.hardware.plane_size_min == 32 && props.hardware.plane_size_max == 32;
    half && warps_of_32
        && head_dim % 16 == 0
        && head_dim <= 128
        && props.features.matmul.mma.contains(&mma)
        && props.features.copy_async
        && mma::shared_bytes(head_dim, dtype.size(), planes) <= props.hardware.max_shared_memory_size
}
