//! The tensor-core backward (FlashAttention-2 recomputation), as two kernels that need no
//! atomics:
//! - dQ: planes own 16 packed query rows (as the forward); per key tile `S = Q·Kᵀ`,
//!   `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)`, `dQ += dS·K`.
//! - dK/dV: planes own 16 keys; per query tile of every query head of the group,
//!   `Sᵀ = K·Qᵀ`, `dPᵀ = V·dOᵀ`, `dV += Pᵀ·dO`, `dK += dSᵀ·Q`, so GQA gradients sum in registers.
//!
//! `P = exp(capped + bias − lse)` comes from the forward's log-sum-exp, in base 2: the kernels
//! hold `lse · log2 e` per row, so that with neither softcap nor bias a probability is one
//! multiply-add (`s · scale · log2 e − lse · log2 e`) and one `ex2`. `D = Σ dO·O` per row.

use super::super::{AttentionConfig, EMPTY_LSE, bias_at, capped_logit, logit_grad, packed_row};
use super::{
    mma_shape, lane_column, LOG2_E, PLANE_ROWS, TILE, accumulate, fast_exp2, pair_visible, row_block, row_fragments, scores, stage_pair, stage_tile, store_rows, tile_elems, zeros,
};
use cubecl::cmma::MatrixIdent;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

/// `(p, dS)` of one logit: `s` the raw score `q·k`, `dp` the gradient of `p`, `lse2` the row's
/// log-sum-exp times `log2 e`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn probability_and_grad(s: f32, dp: f32, bias: f32, lse2: f32, delta: f32, scale: f32, softcap: f32, #[comptime] config: AttentionConfig) -> (f32, f32) {
    let capped = capped_logit(s, scale, softcap, config);
    let p = if comptime!(config.scaled_score_logits()) {
        fast_exp2(s * (scale * f32::new(LOG2_E)) - lse2)
    } else {
        fast_exp2((capped + bias) * f32::new(LOG2_E) - lse2)
    };
    (p, logit_grad(p, dp, delta, capped, softcap, config))
}

/// dQ kernel, per key tile: scores in `s_acc` and `dP` in `dp_acc` become `dS` in `s_acc`.
/// Rows as in the forward (`rows[2x], rows[2x + 1]` the head and position of vector `x`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn query_tile_grads<F: Float, NC: Size>(
    s_acc: &mut Array<Vector<f32, NC>>,
    dp_acc: &Array<Vector<f32, NC>>,
    bias: &Tensor<F>,
    b: usize,
    rows: &Array<usize>,
    stats: &Array<f32>,
    tile: usize,
    end: usize,
    q_len: usize,
    kv_len: usize,
    window: usize,
    scale: f32,
    softcap: f32,
    #[comptime] config: AttentionConfig,
    #[comptime] masked: bool,
) {
    let nc = NC::value();
    let col0 = lane_column();
    #[unroll]
    for nt in 0..comptime!(TILE / 8) {
        #[unroll]
        for x in 0..2usize {
            let mut reg = s_acc[comptime!(nt * 2 + x)];
            let dp = dp_acc[comptime!(nt * 2 + x)];
            let h = rows[comptime!(2 * x)];
            let i = rows[comptime!(2 * x + 1)];
            #[unroll]
            for e in 0..nc {
                let j = tile + comptime!(nt * 8 + e) + col0;
                let mut value = 0.0f32;
                if !masked || pair_visible(i, j, q_len, end, q_len, kv_len, window, config) {
                    let (_p, ds) = probability_and_grad(reg[e], dp[e], bias_at(bias, b, h, i, j, config), stats[comptime!(2 * x)], stats[comptime!(2 * x + 1)], scale, softcap, config);
                    value = ds;
                }
                reg[e] = value;
            }
            s_acc[comptime!(nt * 2 + x)] = reg;
        }
    }
}

/// dK/dV kernel, per query tile: `Sᵀ` in `st_acc` becomes `Pᵀ`, `dPᵀ` in `dpt_acc` becomes
/// `dSᵀ`. Rows are keys `j0, j1`; columns are query positions `tile + c` of head `h`, whose
/// log-sum-exp (times `log2 e`) and `D` are at `stats[stats_at + c]` and
/// `stats[stats_at + TILE + c]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_tile_grads<F: Float, NC: Size>(
    st_acc: &mut Array<Vector<f32, NC>>,
    dpt_acc: &mut Array<Vector<f32, NC>>,
    bias: &Tensor<F>,
    stats: &SharedMemory<f32>,
    stats_at: usize,
    b: usize,
    h: usize,
    j0: usize,
    j1: usize,
    tile: usize,
    last: usize,
    q_len: usize,
    kv_len: usize,
    window: usize,
    scale: f32,
    softcap: f32,
    #[comptime] config: AttentionConfig,
    #[comptime] masked: bool,
) {
    let nc = NC::value();
    let col0 = lane_column();
    #[unroll]
    for nt in 0..comptime!(TILE / 8) {
        #[unroll]
        for x in 0..2usize {
            let mut p_reg = st_acc[comptime!(nt * 2 + x)];
            let mut ds_reg = dpt_acc[comptime!(nt * 2 + x)];
            let j = if comptime!(x == 0) { j0 } else { j1 };
            #[unroll]
            for e in 0..nc {
                let c = comptime!(nt * 8 + e) + col0;
                let i = tile + c;
                let mut p_value = 0.0f32;
                let mut ds_value = 0.0f32;
                if !masked || pair_visible(i, j, last, kv_len, q_len, kv_len, window, config) {
                    let (p, ds) = probability_and_grad(p_reg[e], ds_reg[e], bias_at(bias, b, h, i, j, config), stats[stats_at + c], stats[stats_at + TILE + c], scale, softcap, config);
                    p_value = p;
                    ds_value = ds;
                }
                p_reg[e] = p_value;
                ds_reg[e] = ds_value;
            }
            st_acc[comptime!(nt * 2 + x)] = p_reg;
            dpt_acc[comptime!(nt * 2 + x)] = ds_reg;
        }
    }
}

/// dQ. Cube `(32, planes)`, grid as the forward's ([`super::row_block`]). K, V as in the forward.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(in super::super) fn mma_backward_q_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    window: usize,
    #[comptime] config: AttentionConfig,
    #[comptime] planes: usize,
    #[define(F)] _dtype: StorageType,
) {
    let def = mma_shape::<F>();
    let d = config.head_dim;
    let streamed = comptime!(tile_elems(TILE, d));
    let threads = comptime!(planes * 32);
    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);

    let q_heads = q.shape(1);
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let block = row_block(q_heads, q_len, k.shape(1), kv_len, window, 1usize, kv_len, config, planes);
    let b = block.b;
    let end = block.end;

    let g = (UNIT_POS_PLANE / 4) as usize;
    let (valid0, h0, i0) = packed_row(block.plane_p0 + g, block.packed, block.head_base, q_len);
    let (valid1, h1, i1) = packed_row(block.plane_p0 + g + 8, block.packed, block.head_base, q_len);
    let mut rows = Array::<usize>::new(4usize);
    rows[0] = h0;
    rows[1] = i0;
    rows[2] = h1;
    rows[3] = i1;
    // (lse · log2 e, D) of both rows; a missing row sees nothing (p = 0).
    let mut stats = Array::<f32>::new(4usize);
    stats[0] = f32::new(EMPTY_LSE);
    stats[1] = 0.0;
    stats[2] = f32::new(EMPTY_LSE);
    stats[3] = 0.0;
    if valid0 {
        let (l, dl) = row_stats(lse, delta, (b * q_heads + h0) * q_len + i0);
        stats[0] = l;
        stats[1] = dl;
    }
    if valid1 {
        let (l, dl) = row_stats(lse, delta, (b * q_heads + h1) * q_len + i1);
        stats[2] = l;
        stats[3] = dl;
    }

    let q_frags = row_fragments::<F, NA>(q, b, block.head_base, block.plane_p0, block.packed, d);
    let do_frags = row_fragments::<F, NA>(d_out, b, block.head_base, block.plane_p0, block.packed, d);
    let mut dq_acc = zeros::<NC>(comptime!(d / 8));
    let mut s_acc = zeros::<NC>(comptime!(TILE / 8));
    let mut dp_acc = zeros::<NC>(comptime!(TILE / 8));

    let mut smem = SharedMemory::<F>::new_aligned(comptime!(4 * streamed), 16usize);
    let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let k_base = b * k.stride(0) + block.kvh * k.stride(1);
    let v_base = b * v.stride(0) + block.kvh * v.stride(1);
    let (k_stride, v_stride) = (k.stride(2), v.stride(2));
    if block.start < end {
        stage_pair(k, v, &mut smem, 0usize, k_base, v_base, k_stride, v_stride, block.start, end, d, threads);
    }
    barrier.commit_copy_async();
    barrier.arrive_and_wait();

    let mut tile = block.start;
    let mut buffer = 0usize;
    while tile < end {
        let next = tile + TILE;
        if next < end {
            stage_pair(k, v, &mut smem, (1 - buffer) * comptime!(2 * streamed), k_base, v_base, k_stride, v_stride, next, end, d, threads);
        }
        let k_tile = buffer * comptime!(2 * streamed);
        scores::<F, NA, NB, NC>(&q_frags, &smem, 0usize, k_tile, &mut s_acc, d, false);
        scores::<F, NA, NB, NC>(&do_frags, &smem, 0usize, k_tile + streamed, &mut dp_acc, d, false);
        if tile < block.free_lo || next > block.free_hi {
            query_tile_grads::<F, NC>(&mut s_acc, &dp_acc, bias, b, &rows, &stats, tile, end, q_len, kv_len, window, scale, softcap, config, true);
        } else {
            query_tile_grads::<F, NC>(&mut s_acc, &dp_acc, bias, b, &rows, &stats, tile, end, q_len, kv_len, window, scale, softcap, config, false);
        }
        accumulate::<F, NA, NB, NC>(&s_acc, &smem, k_tile, &mut dq_acc, d);
        barrier.commit_copy_async();
        barrier.arrive_and_wait();
        tile = next;
        buffer = 1 - buffer;
    }

    let row0 = (b * q_heads + h0) * q_len + i0;
    let row1 = (b * q_heads + h1) * q_len + i1;
    store_rows::<F, NC>(dq, &dq_acc, row0, row1, valid0, valid1, scale, scale, d);
}

/// dK and dV. Cube `(32, planes)`; grid: x = blocks of `planes × 16` keys, y = kv head,
/// z = batch. Q, K, V and dO need the forward's K/V layout (16-byte copyable rows).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(in super::super) fn mma_backward_kv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    window: usize,
    #[comptime] config: AttentionConfig,
    #[comptime] planes: usize,
    #[define(F)] _dtype: StorageType,
) {
    let def = mma_shape::<F>();
    let d = config.head_dim;
    let keys = comptime!(planes * PLANE_ROWS);
    let streamed = comptime!(tile_elems(TILE, d));
    let key_elems = comptime!(tile_elems(planes * PLANE_ROWS, d));
    let threads = comptime!(planes * 32);
    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);

    let q_heads = q.shape(1);
    let q_len = q.shape(2);
    let kv_heads = k.shape(1);
    let kv_len = k.shape(2);
    let group = q_heads / kv_heads;
    let kvh = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let first_key = CUBE_POS_X as usize * keys;
    let last_key = cubecl::prelude::min(first_key + keys, kv_len) - 1;
    let plane = UNIT_POS_Y as usize;
    let g = (UNIT_POS_PLANE / 4) as usize;
    let j0 = first_key + plane * PLANE_ROWS + g;
    let j1 = j0 + 8;

    // Query positions [first, last) that see some key of the block, and [lo, hi) that see all.
    let mut first = 0usize;
    let mut last = q_len;
    let mut lo = 0usize;
    let mut hi = q_len;
    if comptime!(config.causal) {
        if first_key + q_len > kv_len {
            first = first_key + q_len - kv_len;
        }
        if last_key + q_len > kv_len {
            lo = last_key + q_len - kv_len;
        }
    }
    if comptime!(config.window) {
        last = 0;
        if last_key + q_len + window > kv_len {
            last = cubecl::prelude::min(last_key + q_len + window - kv_len, q_len);
        }
        hi = 0;
        if first_key + q_len + window > kv_len {
            hi = cubecl::prelude::min(first_key + q_len + window - kv_len, q_len);
        }
    }
    if first_key + keys > kv_len {
        // A partial block: its missing keys must not read the bias, so every tile masks.
        hi = 0;
    }
    let tiles = (cubecl::prelude::max(last, first) - first + comptime!(TILE - 1)) / TILE;
    let steps = group * tiles;

    // K and V of the block's keys, then two buffers of (Q tile, dO tile); f32 stats: two buffers
    // of (lse, D) for the tile's queries.
    let mut smem = SharedMemory::<F>::new_aligned(comptime!(2 * key_elems + 4 * streamed), 16usize);
    let mut stats = SharedMemory::<f32>::new(comptime!(4 * TILE));
    let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let kv_base = b * k.stride(0) + kvh * k.stride(1);
    stage_tile(k, &mut smem, 0usize, kv_base, k.stride(2), first_key, kv_len, keys, d, threads);
    stage_tile(v, &mut smem, key_elems, b * v.stride(0) + kvh * v.stride(1), v.stride(2), first_key, kv_len, keys, d, threads);
    let (q_stride, do_stride) = (q.stride(2), d_out.stride(2));

    let qt = comptime!(2 * key_elems);
    let mut stat_lse = f32::new(EMPTY_LSE);
    let mut stat_delta = 0.0f32;
    if steps > 0 {
        let h = kvh * group;
        let q_base = b * q.stride(0) + h * q.stride(1);
        let do_base = b * d_out.stride(0) + h * d_out.stride(1);
        stage_pair(q, d_out, &mut smem, qt, q_base, do_base, q_stride, do_stride, first, last, d, threads);
        let t = UNIT_POS as usize;
        if t < TILE {
            let (l, dl) = query_stats(lse, delta, b, h, q_heads, q_len, first + t, last);
            stats[t] = l;
            stats[TILE + t] = dl;
        }
    }
    barrier.commit_copy_async();
    barrier.arrive_and_wait();

    let mut dk_acc = zeros::<NC>(comptime!(d / 8));
    let mut dv_acc = zeros::<NC>(comptime!(d / 8));
    let mut st_acc = zeros::<NC>(comptime!(TILE / 8));
    let mut dpt_acc = zeros::<NC>(comptime!(TILE / 8));
    // Both products take their A operand (this plane's keys) from shared memory, so `scores`
    // gets no register fragments.
    let none = Array::<Vector<F, NA>>::new(1usize);
    // This plane's 16 keys in the K tile (and, `key_elems` further, in the V tile).
    let a_at = plane * comptime!(tile_elems(PLANE_ROWS, d));
    let mut buffer = 0usize;
    for step in 0..steps {
        let h = kvh * group + step / tiles;
        let tile = first + (step % tiles) * TILE;
        if step + 1 < steps {
            let h_next = kvh * group + (step + 1) / tiles;
            let tile_next = first + ((step + 1) % tiles) * TILE;
            let other = qt + (1 - buffer) * comptime!(2 * streamed);
            let (q_base, do_base) = (b * q.stride(0) + h_next * q.stride(1), b * d_out.stride(0) + h_next * d_out.stride(1));
            stage_pair(q, d_out, &mut smem, other, q_base, do_base, q_stride, do_stride, tile_next, last, d, threads);
            let t = UNIT_POS as usize;
            if t < TILE {
                let (l, dl) = query_stats(lse, delta, b, h_next, q_heads, q_len, tile_next + t, last);
                stat_lse = l;
                stat_delta = dl;
            }
        }
        let q_tile = qt + buffer * comptime!(2 * streamed);
        let stats_at = buffer * comptime!(2 * TILE);
        scores::<F, NA, NB, NC>(&none, &smem, a_at, q_tile, &mut st_acc, d, true);
        scores::<F, NA, NB, NC>(&none, &smem, a_at + key_elems, q_tile + streamed, &mut dpt_acc, d, true);
        if tile < lo || tile + TILE > hi {
            key_tile_grads::<F, NC>(&mut st_acc, &mut dpt_acc, bias, &stats, stats_at, b, h, j0, j1, tile, last, q_len, kv_len, window, scale, softcap, config, true);
        } else {
            key_tile_grads::<F, NC>(&mut st_acc, &mut dpt_acc, bias, &stats, stats_at, b, h, j0, j1, tile, last, q_len, kv_len, window, scale, softcap, config, false);
        }
        accumulate::<F, NA, NB, NC>(&st_acc, &smem, q_tile + streamed, &mut dv_acc, d);
        accumulate::<F, NA, NB, NC>(&dpt_acc, &smem, q_tile, &mut dk_acc, d);
        if step + 1 < steps {
            let t = UNIT_POS as usize;
            if t < TILE {
                let at = (1 - buffer) * comptime!(2 * TILE);
                stats[at + t] = stat_lse;
                stats[at + TILE + t] = stat_delta;
            }
        }
        barrier.commit_copy_async();
        barrier.arrive_and_wait();
        buffer = 1 - buffer;
    }

    let key0 = (b * kv_heads + kvh) * kv_len + j0;
    let key1 = (b * kv_heads + kvh) * kv_len + j1;
    store_rows::<F, NC>(dk, &dk_acc, key0, key1, j0 < kv_len, j1 < kv_len, scale, scale, d);
    store_rows::<F, NC>(dv, &dv_acc, key0, key1, j0 < kv_len, j1 < kv_len, 1.0, 1.0, d);
}

/// `(lse · log2 e, D)` of query `i` of head `h`, or a row that sees nothing past `last`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn query_stats(lse: &Tensor<f32>, delta: &Tensor<f32>, b: usize, h: usize, q_heads: usize, q_len: usize, i: usize, last: usize) -> (f32, f32) {
    let mut l = f32::new(EMPTY_LSE);
    let mut dl = 0.0f32;
    if i < last {
        let (row_lse, row_delta) = row_stats(lse, delta, (b * q_heads + h) * q_len + i);
        l = row_lse;
        dl = row_delta;
    }
    (l, dl)
}

/// `(lse · log2 e, D)` of the row at `at`: the backward's statistics in the base-2 units its
/// probabilities use.
#[cube]
fn row_stats(lse: &Tensor<f32>, delta: &Tensor<f32>, at: usize) -> (f32, f32) {
    (lse[at] * f32::new(LOG2_E), delta[at])
}
