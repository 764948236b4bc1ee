//! The tensor-core forward: each plane owns 16 packed query rows and keeps its Q fragments,
//! scores, probabilities and output accumulators in registers; K and V tiles stream through
//! shared memory. Only key tiles that cross a causal/window edge or the end of the keys evaluate
//! the mask.

use super::super::{AttentionConfig, EMPTY_LSE, MASKED, bias_at, capped_logit, packed_row};
use super::{mma_shape, LOG2_E, TILE, lane_column, accumulate, fast_exp2, pair_visible, quad_max, quad_sum, row_block, row_fragments, scores, stage_pair, store_rows, tile_elems, zeros};
use cubecl::cmma::MatrixIdent;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

/// Turn this lane's scores of one key tile in place into the values the softmax runs on (see
/// [`mma_forward_kernel`]'s `raw`): the raw scores, or the scaled, capped and biased logits; for
/// `masked` tiles masked ones become `MASKED`. Returns the maxima of the lane's two rows.
/// Accumulator vector `x` holds row `x`, whose `(head, position)` are `rows[2x], rows[2x + 1]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn tile_logits<F: Float, NC: Size>(
    s_acc: &mut Array<Vector<f32, NC>>,
    bias: &Tensor<F>,
    b: usize,
    rows: &Array<usize>,
    valid: &Array<bool>,
    tile: usize,
    end: usize,
    q_len: usize,
    kv_len: usize,
    window: usize,
    scale: f32,
    softcap: f32,
    #[comptime] config: AttentionConfig,
    #[comptime] raw: bool,
    #[comptime] masked: bool,
) -> (f32, f32) {
    let nc = NC::value();
    let col0 = lane_column();
    let mut maxima = partials(f32::new(MASKED));
    #[unroll]
    for nt in 0..comptime!(TILE / 8) {
        #[unroll]
        for x in 0..2usize {
            let mut reg = s_acc[comptime!(nt * 2 + x)];
            let h = rows[comptime!(2 * x)];
            let i = rows[comptime!(2 * x + 1)];
            #[unroll]
            for e in 0..nc {
                let j = tile + comptime!(nt * 8 + e) + col0;
                // Masked logits never read the bias: (i, j) may lie outside it.
                let mut s = f32::new(MASKED);
                if !masked || (valid[x] && pair_visible(i, j, q_len, end, q_len, kv_len, window, config)) {
                    s = if comptime!(raw) { reg[e] } else { capped_logit(reg[e], scale, softcap, config) + bias_at(bias, b, h, i, j, config) };
                }
                let at = comptime!(partial_slot(x, nt, e));
                maxima[at] = maxima[at].max(s);
                reg[e] = s;
            }
            s_acc[comptime!(nt * 2 + x)] = reg;
        }
    }
    (
        maxima[0].max(maxima[1]).max(maxima[2].max(maxima[3])),
        maxima[4].max(maxima[5]).max(maxima[6].max(maxima[7])),
    )
}

/// Turn this lane's softmax inputs `x` into `2^(u·x − u·max)` in place (masked ones into 0) and
/// return the lane's partial sums of its two rows.
#[cube]
fn tile_probabilities<NC: Size>(s_acc: &mut Array<Vector<f32, NC>>, max0: f32, max1: f32, u: f32, #[comptime] masked: bool) -> (f32, f32) {
    let nc = NC::value();
    let mut sums = partials(0.0f32);
    let (shift0, shift1) = (max0 * u, max1 * u);
    #[unroll]
    for nt in 0..comptime!(TILE / 8) {
        #[unroll]
        for x in 0..2usize {
            let mut reg = s_acc[comptime!(nt * 2 + x)];
            let shift = if comptime!(x == 0) { shift0 } else { shift1 };
            #[unroll]
            for e in 0..nc {
                let mut p = fast_exp2(reg[e] * u - shift);
                if comptime!(masked) {
                    if reg[e] <= MASKED {
                        p = 0.0;
                    }
                }
                let at = comptime!(partial_slot(x, nt, e));
                sums[at] += p;
                reg[e] = p;
            }
            s_acc[comptime!(nt * 2 + x)] = reg;
        }
    }
    ((sums[0] + sums[1]) + (sums[2] + sums[3]), (sums[4] + sums[5]) + (sums[6] + sums[7]))
}

/// Four running partials for each of the lane's two rows, all `init`: a row's 16 values per
/// tile fold into four short chains instead of one 16-long chain of dependent instructions,
/// whose latency two planes per scheduler cannot hide.
#[cube]
fn partials(init: f32) -> Array<f32> {
    let mut values = Array::<f32>::new(8usize);
    #[unroll]
    for i in 0..8usize {
        values[i] = init;
    }
    values
}

/// The partial of row `x` that value `e` of accumulator tile `nt` folds into.
const fn partial_slot(x: usize, nt: usize, e: usize) -> usize {
    x * 4 + (nt % 2) * 2 + e % 2
}

/// Cube `(32, planes)`, grid as [`row_block`]. K and V need a unit last stride, other strides
/// that are multiples of 8 elements and 16-byte aligned starts (the host checks). With
/// `splits > 1`, `out` and `lse` are the f32 partials `[splits, batch, q_heads, q_len(, d)]` of
/// the portable forward, each normalized over its split's keys.
///
/// The softmax runs in base 2 on values `x` with a per-kernel factor `u`: `p = 2^(u·x − u·max)`,
/// one multiply-add and one `ex2` per probability. With `raw` (no softcap, no bias and a
/// positive scale, which the host checks) `x` is the raw score `q·k` and `u = scale · log2 e`,
/// so the scale costs nothing per score; otherwise `x` is the full logit and `u = log2 e`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(in super::super) fn mma_forward_kernel<F: Float, O: Float>(
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
    #[comptime] planes: usize,
    #[comptime] raw: bool,
    #[define(F, O)] _types: [StorageType; 2],
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
    let block = row_block(q_heads, q_len, k.shape(1), kv_len, window, splits, split_len, config, planes);
    let b = block.b;
    let end = block.end;

    // The two rows this lane holds in accumulators: g and g + 8 of the plane's 16.
    let g = (UNIT_POS_PLANE / 4) as usize;
    let col0 = lane_column();
    let (valid0, h0, i0) = packed_row(block.plane_p0 + g, block.packed, block.head_base, q_len);
    let (valid1, h1, i1) = packed_row(block.plane_p0 + g + 8, block.packed, block.head_base, q_len);
    let mut rows = Array::<usize>::new(4usize);
    rows[0] = h0;
    rows[1] = i0;
    rows[2] = h1;
    rows[3] = i1;
    let mut valid = Array::<bool>::new(2usize);
    valid[0] = valid0;
    valid[1] = valid1;

    let q_frags = row_fragments::<F, NA>(q, b, block.head_base, block.plane_p0, block.packed, d);
    let mut o_acc = zeros::<NC>(comptime!(d / 8));
    let mut s_acc = zeros::<NC>(comptime!(TILE / 8));
    let mut m0 = f32::new(MASKED);
    let mut m1 = f32::new(MASKED);
    let mut l0 = 0.0f32;
    let mut l1 = 0.0f32;
    // `x · unit` is a logit; `x · u` the same in base 2.
    let unit = if comptime!(raw) { scale } else { f32::new(1.0) };
    let u = unit * f32::new(LOG2_E);

    // Buffer n (0 or 1) holds K at `2n · streamed` elements and V right after it.
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

        // Online softmax; the mask only where a tile crosses an edge.
        let masked = tile < block.free_lo || next > block.free_hi;
        let (max0, max1) = if masked {
            tile_logits::<F, NC>(&mut s_acc, bias, b, &rows, &valid, tile, end, q_len, kv_len, window, scale, softcap, config, raw, true)
        } else {
            tile_logits::<F, NC>(&mut s_acc, bias, b, &rows, &valid, tile, end, q_len, kv_len, window, scale, softcap, config, raw, false)
        };
        let new0 = m0.max(quad_max(max0));
        let new1 = m1.max(quad_max(max1));
        let alpha0 = fast_exp2((m0 - new0) * u);
        let alpha1 = fast_exp2((m1 - new1) * u);
        // Once the running maxima settle, most tiles raise none of the plane's: then every
        // alpha is exactly 1 and the plane skips rescaling its output accumulators.
        let rescale = plane_any(new0 != m0 || new1 != m1);
        m0 = new0;
        m1 = new1;
        let (sum0, sum1) = if masked {
            tile_probabilities::<NC>(&mut s_acc, new0, new1, u, true)
        } else {
            tile_probabilities::<NC>(&mut s_acc, new0, new1, u, false)
        };
        // Each lane keeps its partial row sums; the quad adds them up once at the end.
        l0 = l0 * alpha0 + sum0;
        l1 = l1 * alpha1 + sum1;
        if rescale {
            #[unroll]
            for dt in 0..comptime!(d / 8) {
                o_acc[comptime!(dt * 2)] = o_acc[comptime!(dt * 2)] * Vector::new(alpha0);
                o_acc[comptime!(dt * 2 + 1)] = o_acc[comptime!(dt * 2 + 1)] * Vector::new(alpha1);
            }
        }

        accumulate::<F, NA, NB, NC>(&s_acc, &smem, 0usize, k_tile + streamed, &mut o_acc, false, TILE, d, d);

        // Lands tile n + 1 and frees this buffer for tile n + 2.
        barrier.commit_copy_async();
        barrier.arrive_and_wait();
        tile = next;
        buffer = 1 - buffer;
    }

    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    let mut inv0 = 0.0f32;
    let mut inv1 = 0.0f32;
    if l0 > 0.0 {
        inv0 = 1.0 / l0;
    }
    if l1 > 0.0 {
        inv1 = 1.0 / l1;
    }
    let batch_row = block.split * q.shape(0) + b;
    let stat0 = (batch_row * q_heads + h0) * q_len + i0;
    let stat1 = (batch_row * q_heads + h1) * q_len + i1;
    store_rows::<O, NC>(out, &o_acc, stat0, stat1, valid0, valid1, inv0, inv1, d);
    if col0 == 0 {
        let mut value0 = f32::new(EMPTY_LSE);
        let mut value1 = f32::new(EMPTY_LSE);
        if l0 > 0.0 {
            value0 = m0 * unit + l0.ln();
        }
        if l1 > 0.0 {
            value1 = m1 * unit + l1.ln();
        }
        if valid0 {
            lse[stat0] = value0;
        }
        if valid1 {
            lse[stat1] = value1;
        }
    }
}
