//! Flash attention: tiled online-softmax attention that never materializes the `q_len × kv_len`
//! score matrix, its FlashAttention-2 backward, and split-KV decoding.
//!
//! Layout: q `[batch, q_heads, q_len, d]`, k/v `[batch, kv_heads, kv_len, d]` (any strides),
//! optional additive bias `[batch, q_heads, q_len, kv_len]` (broadcast dims pass stride 0).
//! Logit of query `i` and key `j`: `s = softcap(scale · q·k) + bias`, with
//! `softcap(x) = c · tanh(x / c)` when enabled. Key `j` is visible to query `i` when
//! - causal: `j ≤ i + kv_len − q_len` (bottom-right aligned, as with a KV cache);
//! - sliding window `w`: `j > i + kv_len − q_len − w`.
//!
//! A row with no visible key gets output 0 and a log-sum-exp of [`EMPTY_LSE`].
//!
//! GQA without repeated K/V: a cube works for one kv head and packs the `group = q_heads / kv_heads`
//! query heads that share it into its rows ("packed rows" `p = g · q_len + i`), so each K/V tile
//! is read once for the whole group. With `q_len` of one to a few tokens (decoding) that also fills
//! the cube's rows, and the KV length is split over cubes (`splits > 1`): each split writes a
//! normalized partial output and its log-sum-exp in f32, and [`launch_combine`] merges them.
//!
//! Inside a cube, `block_q` rows × `lanes` units: a row's lanes split the keys of a tile for the
//! scores and the head dimension for the output. Tiles live in shared memory as f32, so f16/bf16
//! inputs accumulate in f32.

mod backward;
mod mma;
mod plan;
#[cfg(feature = "cuda")]
pub mod wgmma;

pub use backward::{BackwardArgs, launch_backward, launch_row_dot};
pub use plan::{AttentionFeatures, AttentionPlan, AttentionShape, HeadDimTooLarge};

use crate::row::{RowLayout, plane_size_for_reduction, row_max, row_sum};
use cubecl::prelude::*;

use crate::measurement_override;

/// Log-sum-exp stored for a row that sees no key: large enough that `exp(s − lse)` is 0.
pub const EMPTY_LSE: f32 = 1.0e30;
/// Logit of a masked key: below any real logit, finite so that differences stay defined.
const MASKED: f32 = -1.0e30;

/// Compile-time shape and features of an attention launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionConfig {
    pub head_dim: usize,
    /// Rows (packed query rows, or keys in the dK/dV kernel) per cube.
    pub block_q: usize,
    /// Keys (or query rows in the dK/dV kernel) per shared-memory tile.
    pub block_k: usize,
    /// Units per row.
    pub lanes: usize,
    /// Plane size for row reductions (0: shared memory only).
    pub plane_size: usize,
    pub causal: bool,
    pub window: bool,
    pub softcap: bool,
    pub bias: bool,
    /// Unroll the inner loops. On GPUs that keeps per-lane arrays in registers; the Vulkan
    /// software driver (lavapipe), which compiles every barrier-separated region as a coroutine,
    /// takes minutes to compile the unrolled kernels, so there loops stay loops.
    pub unroll: bool,
}

impl AttentionConfig {
    fn rows(self) -> RowLayout {
        RowLayout { units_per_row: self.lanes, rows_per_cube: self.block_q, vectors_per_unit: 1, plane_size: self.plane_size }
    }

    fn units(self) -> usize {
        self.lanes * self.block_q
    }

    /// Whether a logit is the scaled score alone (no softcap, no bias): the tensor-core kernels
    /// then fold the scale into the exponent's multiply-add.
    pub fn scaled_score_logits(self) -> bool {
        !self.softcap && !self.bias
    }

    /// Shared memory one forward/dQ cube needs, in bytes.
    pub fn forward_shared_bytes(self) -> usize {
        4 * (2 * self.block_q * self.head_dim + 2 * self.block_k * self.head_dim + self.block_q * self.block_k)
    }

    /// Shared memory one dK/dV cube needs, in bytes (`block_q` keys, `block_k` queries per tile).
    pub fn backward_kv_shared_bytes(self) -> usize {
        4 * (2 * self.block_q * self.head_dim + 2 * self.block_k * self.head_dim + 2 * self.block_q * self.block_k + 2 * self.block_k)
    }
}

/// Whether key `j` is visible to query `i` (no negative intermediate: all terms moved across).
#[cube]
fn visible(i: usize, j: usize, q_len: usize, kv_len: usize, window: usize, #[comptime] config: AttentionConfig) -> bool {
    let mut ok = j < kv_len;
    if comptime!(config.causal) {
        ok = ok && j + q_len <= i + kv_len;
    }
    if comptime!(config.window) {
        ok = ok && i + kv_len < j + q_len + window;
    }
    ok
}

/// First and one-past-last key any query position in `[i_lo, i_hi]` can see.
#[cube]
fn key_range(i_lo: usize, i_hi: usize, q_len: usize, kv_len: usize, window: usize, #[comptime] config: AttentionConfig) -> (usize, usize) {
    let mut start = 0usize;
    let mut end = kv_len;
    if comptime!(config.window) {
        if i_lo + kv_len + 1 > q_len + window {
            start = i_lo + kv_len + 1 - q_len - window;
        }
    }
    if comptime!(config.causal) {
        end = 0;
        if i_hi + kv_len + 1 > q_len {
            end = cubecl::prelude::min(i_hi + kv_len + 1 - q_len, kv_len);
        }
    }
    (start, end)
}

/// `softcap(scale · dot)`: the logit before the bias, which the backward needs for the softcap's
/// derivative.
#[cube]
fn capped_logit(dot: f32, scale: f32, softcap: f32, #[comptime] config: AttentionConfig) -> f32 {
    let mut s = dot * scale;
    if comptime!(config.softcap) {
        s = softcap * (s / softcap).tanh();
    }
    s
}

/// Bias of `(batch, head, i, j)`, 0 without a bias.
#[cube]
fn bias_at<F: Float>(bias: &Tensor<F>, b: usize, h: usize, i: usize, j: usize, #[comptime] config: AttentionConfig) -> f32 {
    let mut value = 0.0f32;
    if comptime!(config.bias) {
        value = f32::cast_from(bias[b * bias.stride(0) + h * bias.stride(1) + i * bias.stride(2) + j * bias.stride(3)]);
    }
    value
}

/// Copy `rows × head_dim` values of heads `[b, h, i, :]` into a tile, where packed row `p` of the
/// tile maps to head `head_base + p / q_len` and position `p % q_len`; rows past `rows_end` are 0.
#[cube]
fn load_packed_rows<F: Float>(
    src: &Tensor<F>,
    tile: &mut SharedMemory<f32>,
    b: usize,
    head_base: usize,
    first_row: usize,
    rows_end: usize,
    #[comptime] rows: usize,
    #[comptime] config: AttentionConfig,
) {
    let d = config.head_dim;
    let q_len = src.shape(2);
    let mut t = UNIT_POS as usize;
    while t < rows * d {
        let r = t / d;
        let c = t % d;
        let p = first_row + r;
        let mut value = 0.0f32;
        if p < rows_end {
            let h = head_base + p / q_len;
            let i = p % q_len;
            value = f32::cast_from(src[b * src.stride(0) + h * src.stride(1) + i * src.stride(2) + c * src.stride(3)]);
        }
        tile[t] = value;
        t += comptime!(config.units());
    }
}

/// Copy keys (or values) `[b, h, start .. start + rows, :]` into a tile; rows past `end` are 0.
#[cube]
fn load_rows<F: Float>(
    src: &Tensor<F>,
    tile: &mut SharedMemory<f32>,
    b: usize,
    h: usize,
    start: usize,
    end: usize,
    #[comptime] rows: usize,
    #[comptime] config: AttentionConfig,
) {
    let d = config.head_dim;
    let mut t = UNIT_POS as usize;
    while t < rows * d {
        let r = t / d;
        let c = t % d;
        let mut value = 0.0f32;
        if start + r < end {
            value = f32::cast_from(src[b * src.stride(0) + h * src.stride(1) + (start + r) * src.stride(2) + c * src.stride(3)]);
        }
        tile[t] = value;
        t += comptime!(config.units());
    }
}

/// Dot product of row `a` of tile `x` and row `b` of tile `y` (both `head_dim` wide).
#[cube]
fn row_dot(x: &SharedMemory<f32>, a: usize, y: &SharedMemory<f32>, b: usize, #[comptime] d: usize, #[comptime] unroll: bool) -> f32 {
    let mut total = 0.0f32;
    #[unroll(unroll)]
    for e in 0..d {
        total += x[a * d + e] * y[b * d + e];
    }
    total
}

/// Where this unit's packed row lives: `(valid, head, position)`.
#[cube]
fn packed_row(p: usize, packed: usize, head_base: usize, q_len: usize) -> (bool, usize, usize) {
    let valid = p < packed;
    let mut h = head_base;
    let mut i = 0usize;
    if valid {
        h = head_base + p / q_len;
        i = p % q_len;
    }
    (valid, h, i)
}

/// Query positions spanned by packed rows `[p0, p_last]`: the whole sequence when the block wraps
/// from one head of the group to the next.
#[cube]
fn position_span(p0: usize, p_last: usize, q_len: usize) -> (usize, usize) {
    let mut lo = 0usize;
    let mut hi = q_len - 1;
    if p0 / q_len == p_last / q_len {
        lo = p0 % q_len;
        hi = p_last % q_len;
    }
    (lo, hi)
}

/// Forward. Grid: x = blocks of packed rows, y = kv head, z = batch × splits.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float, O: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    out: &mut Tensor<O>,
    lse: &mut Tensor<f32>,
    scale: f32,
    softcap: f32,
    window: usize,
    splits: usize,
    split_len: usize,
    #[comptime] config: AttentionConfig,
    #[define(F, O)] _types: [StorageType; 2],
) {
    let d = config.head_dim;
    let lanes = config.lanes;
    let block_k = config.block_k;
    let keys_per_lane = comptime!(block_k.div_ceil(lanes));
    let cols_per_lane = comptime!(d.div_ceil(lanes));
    let lane = UNIT_POS_X as usize;
    let row = UNIT_POS_Y as usize;

    let batch = q.shape(0);
    let q_heads = q.shape(1);
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let group = q_heads / k.shape(1);
    let kvh = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize / splits;
    let split = CUBE_POS_Z as usize % splits;
    let head_base = kvh * group;
    let packed = group * q_len;
    let p0 = CUBE_POS_X as usize * config.block_q;
    let (row_valid, h, i) = packed_row(p0 + row, packed, head_base, q_len);
    let (i_lo, i_hi) = position_span(p0, cubecl::prelude::min(p0 + config.block_q, packed) - 1, q_len);
    let (mut start, mut end) = key_range(i_lo, i_hi, q_len, kv_len, window, config);
    start = cubecl::prelude::max(start, split * split_len);
    end = cubecl::prelude::min(end, split * split_len + split_len);

    let mut q_tile = SharedMemory::<f32>::new(comptime!(config.block_q * d));
    let mut k_tile = SharedMemory::<f32>::new(comptime!(block_k * d));
    let mut v_tile = SharedMemory::<f32>::new(comptime!(block_k * d));
    let mut p_tile = SharedMemory::<f32>::new(comptime!(config.block_q * block_k));
    load_packed_rows(q, &mut q_tile, b, head_base, p0, packed, config.block_q, config);

    let mut acc = Array::<f32>::new(cols_per_lane);
    #[unroll(config.unroll)]
    for c in 0..cols_per_lane {
        acc[c] = 0.0;
    }
    let mut scores = Array::<f32>::new(keys_per_lane);
    let mut m = f32::new(MASKED);
    let mut l = 0.0f32;
    let mut tile = start;
    while tile < end {
        sync_cube();
        load_rows(k, &mut k_tile, b, kvh, tile, end, block_k, config);
        load_rows(v, &mut v_tile, b, kvh, tile, end, block_k, config);
        sync_cube();
        let mut tile_max = f32::new(MASKED);
        #[unroll(config.unroll)]
        for t in 0..keys_per_lane {
            let c = lane + t * lanes;
            let j = tile + c;
            let mut s = f32::new(MASKED);
            if row_valid && c < block_k && j < end && visible(i, j, q_len, kv_len, window, config) {
                s = capped_logit(row_dot(&q_tile, row, &k_tile, c, d, config.unroll), scale, softcap, config) + bias_at(bias, b, h, i, j, config);
                tile_max = tile_max.max(s);
            }
            scores[t] = s;
        }
        let m_new = m.max(row_max(tile_max, comptime!(config.rows())));
        let mut sum = 0.0f32;
        #[unroll(config.unroll)]
        for t in 0..keys_per_lane {
            let c = lane + t * lanes;
            let mut p = 0.0f32;
            if scores[t] > MASKED {
                p = (scores[t] - m_new).exp();
            }
            if c < block_k {
                p_tile[row * block_k + c] = p;
            }
            sum += p;
        }
        let alpha = (m - m_new).exp();
        l = l * alpha + row_sum(sum, comptime!(config.rows()));
        m = m_new;
        sync_cube();
        #[unroll(config.unroll)]
        for cc in 0..cols_per_lane {
            let col = lane + cc * lanes;
            if col < d {
                let mut a = acc[cc] * alpha;
                for c in 0..block_k {
                    a += p_tile[row * block_k + c] * v_tile[c * d + col];
                }
                acc[cc] = a;
            }
        }
        tile += block_k;
    }

    if row_valid {
        let out_row = ((split * batch + b) * q_heads + h) * q_len + i;
        let mut inv = 0.0f32;
        if l > 0.0 {
            inv = 1.0 / l;
        }
        #[unroll(config.unroll)]
        for cc in 0..cols_per_lane {
            let col = lane + cc * lanes;
            if col < d {
                out[out_row * d + col] = O::cast_from(acc[cc] * inv);
            }
        }
        if lane == 0 {
            let mut value = f32::new(EMPTY_LSE);
            if l > 0.0 {
                value = m + l.ln();
            }
            lse[out_row] = value;
        }
    }
}

/// Merge split-KV partials: `out = Σ_s w_s · o_s / Σ_s w_s` with `w_s = exp(lse_s − top)`, `top`
/// the largest split log-sum-exp, and `lse = top + ln Σ_s w_s`. Partials `[splits, rows, d]` f32.
///
/// One cube per row (grid x · y ≥ `rows`), units `(column, group)`: `groups` groups take the
/// splits in turn, so a row's splits are read in parallel; `cols` columns at a time. Decoding has
/// few rows and many splits: one unit per output element looping over every split ran tens of
/// sequential loads per unit on a few dozen warps.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn combine_kernel<O: Float>(
    partial_out: &Array<f32>,
    partial_lse: &Array<f32>,
    out: &mut Array<O>,
    lse: &mut Array<f32>,
    splits: usize,
    rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] cols: usize,
    #[comptime] groups: usize,
    #[define(O)] _dtype: StorageType,
) {
    let r = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let group = UNIT_POS_Y as usize;
    let unit = UNIT_POS as usize;
    let units = comptime!(cols * groups);
    let mut values = SharedMemory::<f32>::new(units);
    let mut weights = SharedMemory::<f32>::new(units);
    // Each unit's largest split lse, then the cube's by a tree over shared memory.
    let mut top = f32::new(MASKED);
    if r < rows {
        let mut s = unit;
        while s < splits {
            let value = partial_lse[s * rows + r];
            if value < EMPTY_LSE {
                top = top.max(value);
            }
            s += units;
        }
    }
    values[unit] = top;
    sync_cube();
    let mut stride = comptime!(units.next_power_of_two() / 2).runtime();
    while stride > 0 {
        if unit < stride && unit + stride < units {
            values[unit] = values[unit].max(values[unit + stride]);
        }
        sync_cube();
        stride /= 2;
    }
    top = values[0];
    sync_cube();
    let mut c0 = 0usize;
    while c0 < head_dim {
        let column = c0 + UNIT_POS_X as usize;
        // This group's weighted sum of its splits' values in this column, and of its weights.
        let mut acc = 0.0f32;
        let mut total = 0.0f32;
        if r < rows && column < head_dim {
            let mut s = group;
            while s < splits {
                let value = partial_lse[s * rows + r];
                if value < EMPTY_LSE {
                    let w = (value - top).exp();
                    total += w;
                    acc += w * partial_out[(s * rows + r) * head_dim + column];
                }
                s += groups;
            }
        }
        values[unit] = acc;
        weights[unit] = total;
        sync_cube();
        if group == 0 && r < rows && column < head_dim {
            #[unroll]
            for g in 1..groups {
                acc += values[comptime!(g * cols) + unit];
                total += weights[comptime!(g * cols) + unit];
            }
            let mut result = 0.0f32;
            let mut row_lse = f32::new(EMPTY_LSE);
            if total > 0.0 {
                result = acc / total;
                row_lse = top + total.ln();
            }
            out[r * head_dim + column] = O::cast_from(result);
            if column == 0 {
                lse[r] = row_lse;
            }
        }
        sync_cube();
        c0 += cols;
    }
}

/// `dS = P · (dP − D)`, times the softcap's derivative, for one logit: `p` the probability, `dp` the
/// gradient of `p`, `delta = Σ dO·O` of the row, `capped` the pre-bias logit.
#[cube]
fn logit_grad(p: f32, dp: f32, delta: f32, capped: f32, softcap: f32, #[comptime] config: AttentionConfig) -> f32 {
    let mut ds = p * (dp - delta);
    if comptime!(config.softcap) {
        let t = capped / softcap;
        ds *= 1.0 - t * t;
    }
    ds
}

/// Tensors of a forward launch. With `plan.splits > 1`, `out` is f32 `[splits, batch, q_heads,
/// q_len, d]` and `lse` f32 `[splits, batch, q_heads, q_len]` (merge them with
/// [`launch_combine`]); otherwise `out` is contiguous `[batch, q_heads, q_len, d]` in `out_dtype`.
/// With `plan.tensor_cores`, K and V must have a unit last stride, strides that are multiples of
/// 8 elements and 16-byte aligned starts: the kernel copies their rows 16 bytes at a time.
pub struct ForwardArgs<R: Runtime> {
    pub q: TensorArg<R>,
    pub k: TensorArg<R>,
    pub v: TensorArg<R>,
    /// The bias when `config.bias`, else any tensor of the input dtype.
    pub bias: TensorArg<R>,
    pub out: TensorArg<R>,
    pub lse: TensorArg<R>,
}

fn grid(shape: AttentionShape, block: usize, rows: usize, z: usize) -> CubeCount {
    CubeCount::Static(rows.div_ceil(block) as u32, shape.kv_heads as u32, (shape.batch * z) as u32)
}

fn cube_dim(config: AttentionConfig) -> CubeDim {
    CubeDim::new_2d(config.lanes as u32, config.block_q as u32)
}

/// Launch the forward (`dtype` of q/k/v/bias, `out_dtype` of `out`).
pub fn launch_forward<R: Runtime>(
    client: &ComputeClient<R>,
    plan: &AttentionPlan,
    shape: AttentionShape,
    features: AttentionFeatures,
    scale: f32,
    dtype: StorageType,
    out_dtype: StorageType,
    args: ForwardArgs<R>,
) {
    let group = shape.q_heads / shape.kv_heads;
    if plan.tensor_cores {
        let rows = plan.planes * mma::PLANE_ROWS;
        // SAFETY: as below; the plan checked that the runtime has m16n8k16 MMA and `cp.async`
        // for `dtype`, 32-lane planes and the shared memory; `out` is the final `[b, hq, sq, d]`
        // output, and K/V rows are 16-byte copyable (see `ForwardArgs`).
        unsafe {
            mma::forward::mma_forward_kernel::launch_unchecked::<R>(
                client,
                grid(shape, rows, group * shape.q_len, plan.splits),
                CubeDim::new_2d(32, plan.planes as u32),
                args.q,
                args.k,
                args.v,
                args.bias,
                args.out,
                args.lse,
                scale,
                features.softcap.unwrap_or(1.0),
                features.window.unwrap_or(0),
                plan.splits,
                plan.split_len,
                plan.config,
                plan.planes,
                plan.config.scaled_score_logits() && scale > 0.0,
                [dtype, out_dtype],
            )
        };
        return;
    }
    // SAFETY: the host checked the shapes (q/k/v/bias agree, q_heads a multiple of kv_heads,
    // grid sizes in range) and allocated `out`/`lse` for `splits`; every index is bounds-checked
    // against those shapes in the kernel.
    unsafe {
        forward_kernel::launch_unchecked::<R>(
            client,
            grid(shape, plan.config.block_q, group * shape.q_len, plan.splits),
            cube_dim(plan.config),
            args.q,
            args.k,
            args.v,
            args.bias,
            args.out,
            args.lse,
            scale,
            features.softcap.unwrap_or(1.0),
            features.window.unwrap_or(0),
            plan.splits,
            plan.split_len,
            plan.config,
            [dtype, out_dtype],
        )
    }
}

/// Merge `splits` partials (`[splits, rows, head_dim]` f32, `[splits, rows]` f32) into `out`
/// (`[rows, head_dim]` of `dtype`) and `lse` (`[rows]` f32), all dense, bound as arrays (see the
/// crate docs).
#[allow(clippy::too_many_arguments)]
pub fn launch_combine<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    splits: usize,
    rows: usize,
    head_dim: usize,
    partial_out: ArrayArg<R>,
    partial_lse: ArrayArg<R>,
    out: ArrayArg<R>,
    lse: ArrayArg<R>,
) {
    // Columns and split groups per cube: all columns if they fit the device's cube, then as many
    // groups as fit and there are splits.
    let max_units = client.properties().hardware.max_units_per_cube.min(1024) as usize;
    let cols = head_dim.min(max_units);
    let groups = (max_units / cols).clamp(1, splits.max(1));
    let x = rows.clamp(1, u16::MAX as usize);
    let count = CubeCount::Static(x as u32, rows.div_ceil(x) as u32, 1);
    let dim = CubeDim::new_2d(cols as u32, groups as u32);
    // SAFETY: the partials hold `splits × rows × head_dim` and `splits × rows` values, the
    // outputs `rows × head_dim` and `rows`; a cube past the last row writes nothing and reads
    // no partial.
    unsafe {
        combine_kernel::launch_unchecked::<R>(client, count, dim, partial_out, partial_lse, out, lse, splits, rows, head_dim, cols, groups, dtype)
    }
}
