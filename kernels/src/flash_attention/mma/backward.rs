//! The tensor-core backward (FlashAttention-2 recomputation) in one kernel. Planes own 16 keys
//! each; per query tile of every query head of the group:
//! - `Sᵀ = K·Qᵀ`, `dPᵀ = V·dOᵀ`, `Pᵀ` and `dSᵀ = Pᵀ ∘ (dPᵀ − D)` in registers;
//! - `dV += Pᵀ·dO`, `dK += dSᵀ·Q` in registers, so GQA gradients sum there;
//! - `dS` goes to shared memory, and `dQ += dS·K` (the tile's queries against the cube's keys)
//!   is added into an f32 accumulator in global memory with atomics.
//!
//! Computing `S` and `dP` once for all three gradients is five products per tile where a
//! separate dQ kernel (atomic-free) needs seven. The price is atomic adds into dQ from every key
//! block: with one scalar add per element they took a third of the backward's time on the H100,
//! so sm_90 adds 16-byte vectors and blocks hold 128 keys where shared memory allows.
//!
//! `P = exp(capped + bias − lse)` comes from the forward's log-sum-exp, in base 2: the kernel
//! holds `lse · log2 e` per row, so that with neither softcap nor bias a probability is one
//! multiply-add (`s · scale · log2 e − lse · log2 e`) and one `ex2`. `D = Σ dO·O` per row.

use super::super::{AttentionConfig, EMPTY_LSE, bias_at, capped_logit, logit_grad};
use super::{
    mma_shape, lane_column, LOG2_E, PLANE_ROWS, TILE, accumulate, clear, fast_exp2, pair_visible, scores, stage_pair, stage_tile, store_rows, tile_elems, zeros,
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

/// Per query tile: `Sᵀ` in `st_acc` becomes `Pᵀ`, `dPᵀ` in `dpt_acc` becomes
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

/// Columns of dQ a plane accumulates at a time before adding them to global memory: at most 64
/// (32 f32 registers per lane, next to the 2 · `d / 4` of dK and dV), and a multiple of 16 that
/// divides `d` (a tensor-core head size is a multiple of 16).
pub(in super::super) fn dq_columns(d: usize) -> usize {
    [64, 32, 16].into_iter().find(|n| d.is_multiple_of(*n)).unwrap_or(16)
}

/// Write this plane's `dSᵀ` (its keys × the tile's queries, in accumulator layout) transposed
/// into the `TILE × keys` block at `ds_at` (query rows `keys + PAD` apart), where every plane's
/// dQ product reads it as an A operand.
#[cube]
fn store_transposed<F: Float, NC: Size>(ds_acc: &Array<Vector<f32, NC>>, smem: &mut SharedMemory<F>, ds_at: usize, #[comptime] keys: usize) {
    let nc = NC::value();
    let row = comptime!(tile_elems(1, keys));
    let key = UNIT_POS_Y as usize * PLANE_ROWS + (UNIT_POS_PLANE / 4) as usize;
    let at = ds_at + lane_column() * row + key;
    #[unroll]
    for nt in 0..comptime!(TILE / 8) {
        #[unroll]
        for x in 0..2usize {
            let values = ds_acc[comptime!(nt * 2 + x)];
            #[unroll]
            for e in 0..nc {
                smem[at + comptime!((nt * 8 + e) * row + x * 8)] = F::cast_from(values[e]);
            }
        }
    }
}

/// `dQ += scale · dS·K` for the tile's queries `[tile, tile + TILE)` of the head whose rows start
/// at row `row_base` of `dq` (f32, contiguous, `d` wide), against the cube's keys. The work is
/// cut into (16-query row tile, `width` columns) items that the planes take in turn; each
/// item's product is added to `dq` with atomics (other key blocks add into the same rows).
/// Queries at or past `last` are skipped.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_query_grads<F: Float, NA: Size, NB: Size, NC: Size, NQ: Size>(
    smem: &SharedMemory<F>,
    ds_at: usize,
    dq: &Tensor<Atomic<Vector<f32, NQ>>>,
    row_base: usize,
    tile: usize,
    last: usize,
    scale: f32,
    #[comptime] planes: usize,
    #[comptime] width: usize,
    #[comptime] d: usize,
) {
    let keys = comptime!(planes * PLANE_ROWS);
    let chunks = comptime!(d / width);
    let g = (UNIT_POS_PLANE / 4) as usize;
    let mut acc = Array::<Vector<f32, NC>>::new(comptime!(width / 4));
    // dS comes from shared memory, so `accumulate` gets no register operand.
    let none = Array::<Vector<f32, NC>>::new(1usize);
    let mut item = UNIT_POS_Y as usize;
    while item < comptime!(TILE / PLANE_ROWS * chunks) {
        let rt = item / chunks;
        let c0 = (item % chunks) * width;
        let a_at = ds_at + rt * comptime!(PLANE_ROWS * tile_elems(1, keys));
        clear::<NC>(&mut acc, comptime!(width / 8));
        accumulate::<F, NA, NB, NC>(&none, smem, a_at, c0, &mut acc, true, keys, width, d);
        let i0 = tile + rt * PLANE_ROWS + g;
        add_tiles::<NC, NQ>(&acc, dq, (row_base + i0) * d + c0, i0 < last, i0 + 8 < last, scale, width, d);
        item += planes;
    }
}

/// Add `scale ×` this lane's `width / 8` accumulator tiles into `dq` at element `at` (row `g`
/// of the tiles; row `g + 8` lies `8 · d` further), rows whose flag is false skipped. With
/// 4-wide vector atomics (sm_90) lanes `t` and `t ^ 1` swap half their values first, so that
/// the even lane holds four consecutive columns of row `g` and the odd lane of row `g + 8`: one
/// 16-byte `red.add` where four scalar ones would go.
///
/// Every value is formed before the first add, and the adds sit under one branch: with a
/// shuffle, a select and a branch between consecutive adds, each add's registers were reused
/// by the next, and the warp stalled on every one (a fifth of the backward's stall samples on
/// the H100).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_tiles<NC: Size, NQ: Size>(
    acc: &Array<Vector<f32, NC>>,
    dq: &Tensor<Atomic<Vector<f32, NQ>>>,
    at: usize,
    ok0: bool,
    ok1: bool,
    scale: f32,
    #[comptime] width: usize,
    #[comptime] d: usize,
) {
    let nc = NC::value();
    let nq = NQ::value();
    let col0 = lane_column();
    let tiles = comptime!(width / 8);
    if comptime!(nq == 4) {
        let odd = UNIT_POS_PLANE % 2 == 1;
        // Even lane: row g, columns [2t, 2t + 4); odd lane: row g + 8, columns [2t − 2, 2t + 2).
        let mut row_at = at + col0;
        let mut ok = ok0;
        if odd {
            row_at = at + comptime!(8 * d) + col0 - 2;
            ok = ok1;
        }
        let mut values = Array::<Vector<f32, NQ>>::new(tiles);
        #[unroll]
        for dt in 0..tiles {
            let upper = acc[comptime!(dt * 2)];
            let lower = acc[comptime!(dt * 2 + 1)];
            let mut mine = upper;
            let mut theirs = lower;
            if odd {
                mine = lower;
                theirs = upper;
            }
            let got0 = plane_shuffle_xor(theirs[0], 1u32);
            let got1 = plane_shuffle_xor(theirs[1], 1u32);
            let mut value = Vector::<f32, NQ>::empty();
            if odd {
                value[0] = got0 * scale;
                value[1] = got1 * scale;
                value[2] = mine[0] * scale;
                value[3] = mine[1] * scale;
            } else {
                value[0] = mine[0] * scale;
                value[1] = mine[1] * scale;
                value[2] = got0 * scale;
                value[3] = got1 * scale;
            }
            values[dt] = value;
        }
        if ok {
            #[unroll]
            for dt in 0..tiles {
                dq[(row_at + comptime!(dt * 8)) / 4].fetch_add(values[dt]);
            }
        }
    } else {
        #[unroll]
        for x in 0..2usize {
            let ok = if comptime!(x == 0) { ok0 } else { ok1 };
            if ok {
                #[unroll]
                for dt in 0..tiles {
                    #[unroll]
                    for e in 0..nc {
                        let mut value = Vector::<f32, NQ>::empty();
                        value[0] = acc[comptime!(dt * 2 + x)][e] * scale;
                        dq[at + comptime!(x * 8 * d + dt * 8 + e) + col0].fetch_add(value);
                    }
                }
            }
        }
    }
}

/// dQ, dK and dV. Cube `(32, planes)`; grid: x = blocks of `planes × 16` keys, y = kv head,
/// z = batch. Q, K, V and dO need the forward's K/V layout (16-byte copyable rows); `dq` is a
/// zeroed f32 accumulator shaped like `q`, contiguous, bound with `NQ`-wide vectors: 4 where the
/// device adds 4-wide f32 vectors atomically, else 1.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(in super::super) fn mma_backward_kernel<F: Float, NQ: Size>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &Tensor<Atomic<Vector<f32, NQ>>>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    window: usize,
    #[comptime] config: AttentionConfig,
    #[comptime] planes: usize,
    #[comptime] dq_width: usize,
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

    // K and V of the block's keys, then two buffers of (Q tile, dO tile), then two of the tile's
    // dS; f32 stats: two buffers of (lse, D) for the tile's queries.
    let ds_at = comptime!(2 * key_elems + 4 * streamed);
    let ds_elems = comptime!(tile_elems(TILE, keys));
    let mut smem = SharedMemory::<F>::new_aligned(comptime!(ds_at + 2 * ds_elems), 16usize);
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
        let ds_tile = ds_at + buffer * ds_elems;
        store_transposed::<F, NC>(&dpt_acc, &mut smem, ds_tile, keys);
        accumulate::<F, NA, NB, NC>(&st_acc, &smem, 0usize, q_tile + streamed, &mut dv_acc, false, TILE, d, d);
        accumulate::<F, NA, NB, NC>(&dpt_acc, &smem, 0usize, q_tile, &mut dk_acc, false, TILE, d, d);
        if step + 1 < steps {
            let t = UNIT_POS as usize;
            if t < TILE {
                let at = (1 - buffer) * comptime!(2 * TILE);
                stats[at + t] = stat_lse;
                stats[at + TILE + t] = stat_delta;
            }
        }
        // One barrier per step: it lands the next tile's copies and statistics, and shows every
        // plane the whole dS, which the dQ products read after it. dS alternates between two
        // buffers, so the next step writes the one that this step's barrier saw every plane
        // finish reading; the dQ products read only dS and K, so the next step may overwrite
        // this step's Q and dO tiles.
        barrier.commit_copy_async();
        barrier.arrive_and_wait();
        add_query_grads::<F, NA, NB, NC, NQ>(&smem, ds_tile, dq, (b * q_heads + h) * q_len, tile, last, scale, planes, dq_width, d);
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
