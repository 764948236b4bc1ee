//! The flash attention forward on tensor cores (CUDA `mma.sync` m16n8k16, f16/bf16 in, f32
//! accumulate), FlashAttention-2 style: each plane owns 16 packed query rows and keeps its Q
//! fragments, scores, probabilities and output accumulators in registers; only K and V tiles go
//! through shared memory.
//!
//! Register layout of `mma.sync.m16n8k16` on CUDA, lane `= 4g + t`:
//! - accumulator (16×8 f32): vector `v` of the lane holds row `g + 8v`, columns `2t, 2t + 1`;
//! - A (16×16): vector `v` holds row `g + 8(v % 2)`, columns `2t + 8(v / 2)` and the next one;
//! - B (16×8): vector `v` holds column `g`, rows `2t + 8v` and the next one.
//!
//! So the two accumulator tiles of keys `[16s, 16s + 8)` and `[16s + 8, 16s + 16)` are, vector
//! for vector, the A fragment of the next product's k-step `s`: the probabilities become the A
//! operand of `P·V` by a cast, without leaving registers.
//!
//! Data movement, the part that decides the speed:
//! - K and V tiles arrive by 16-byte `cp.async` copies into two shared-memory buffers: the copies
//!   of tile `n + 1` fly while tile `n` is computed, and one mbarrier wait per tile both lands them
//!   and tells every plane that the other buffer is free again.
//! - Both tiles stay row-major (one key per row, rows padded by 16 bytes, which puts the eight
//!   rows of an `ldmatrix` on distinct banks). B fragments come from `ldmatrix.x4`: plain for Kᵀ
//!   (a K row holds the fragment's adjacent elements), transposed for V.
//! - Only tiles that cross a causal/window edge or the end of the keys evaluate the mask.

use super::{AttentionConfig, EMPTY_LSE, MASKED, bias_at, capped_logit, key_range, packed_row, position_span, visible};
use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::{Barrier, copy_async_checked};
use cubecl::prelude::*;

/// Rows one plane owns (the MMA's m).
pub(super) const PLANE_ROWS: usize = 16;
/// Keys per shared-memory tile.
pub(super) const TILE_KEYS: usize = 64;
/// Padding of shared-memory rows, in elements (16 bytes).
const PAD: usize = 8;
/// Elements per 16-byte copy.
const CHUNK: usize = 8;

/// Shared memory of one cube, in bytes: two buffers of K and V tiles, plus the barrier.
pub(super) fn shared_bytes(head_dim: usize, elem_size: usize) -> usize {
    elem_size * 4 * TILE_KEYS * (head_dim + PAD) + 64
}

/// `exp` through the hardware approximation (`ex2.approx`): its relative error (~1e-6 over the
/// range of `s − max`) is far below the bf16/f16 rounding of the probabilities it feeds.
#[cube(fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
fn fast_exp(x: f32) -> f32 {
    x.exp()
}

/// Keys `[lo, hi)` that every query position in `[i_lo, i_hi]` sees: tiles inside need no mask.
#[cube]
fn unmasked_keys(i_lo: usize, i_hi: usize, q_len: usize, kv_len: usize, window: usize, start: usize, end: usize, #[comptime] config: AttentionConfig) -> (usize, usize) {
    let mut lo = start;
    let mut hi = end;
    if comptime!(config.causal) {
        // Row i sees j ≤ i + kv_len − q_len: all rows see j < i_lo + kv_len + 1 − q_len.
        hi = 0;
        if i_lo + kv_len + 1 > q_len {
            hi = cubecl::prelude::min(i_lo + kv_len + 1 - q_len, end);
        }
    }
    if comptime!(config.window) {
        // Row i sees j > i + kv_len − q_len − window: all rows see j ≥ i_hi + kv_len + 1 − q_len − window.
        if i_hi + kv_len + 1 > q_len + window {
            lo = cubecl::prelude::max(i_hi + kv_len + 1 - q_len - window, start);
        }
    }
    (lo, hi)
}

/// Issue the `cp.async` copies of rows `[tile, tile + TILE_KEYS)` of one head of `src` (rows from
/// `base`, unit last stride) into the tile at `dst`; rows past `end` are zero-filled.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_tile<F: Float>(
    src: &Tensor<F>,
    smem: &mut SharedMemory<F>,
    dst: usize,
    base: usize,
    tile: usize,
    end: usize,
    #[comptime] d: usize,
    #[comptime] threads: usize,
) {
    let chunks = comptime!(d / CHUNK);
    let total = comptime!(TILE_KEYS * d / CHUNK);
    let stride = comptime!(d + PAD);
    let mut c = UNIT_POS as usize;
    #[unroll]
    for _ in 0..comptime!(total.div_ceil(threads)) {
        if c < total {
            let row = c / chunks;
            let col = (c % chunks) * CHUNK;
            let mut src_row = tile + row;
            let mut len = comptime!(CHUNK).runtime();
            if src_row >= end {
                // Nothing is read; the copy zero-fills, from a row that exists.
                src_row = tile;
                len = 0usize;
            }
            let from = base + src_row * src.stride(2) + col;
            let to = dst + row * stride + col;
            copy_async_checked(&src.slice(from, from + len), &mut smem.slice_mut(to, to + CHUNK), comptime!(CHUNK as u32));
        }
        c += threads;
    }
}

/// Scale, cap, bias and (for `masked` tiles) mask this lane's scores of one key tile in place,
/// returning the maxima of its two rows. Accumulator vector `x` holds row `x`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn tile_logits<F: Float, NC: Size>(
    s_acc: &mut Array<Vector<f32, NC>>,
    bias: &Tensor<F>,
    b: usize,
    rows: &Array<usize>,
    valid: &Array<bool>,
    tile: usize,
    col0: usize,
    end: usize,
    q_len: usize,
    kv_len: usize,
    window: usize,
    scale: f32,
    softcap: f32,
    #[comptime] config: AttentionConfig,
    #[comptime] masked: bool,
) -> (f32, f32) {
    let nc = NC::value();
    let key_tiles = comptime!(TILE_KEYS / 8);
    let mut max0 = f32::new(MASKED);
    let mut max1 = f32::new(MASKED);
    #[unroll]
    for nt in 0..key_tiles {
        #[unroll]
        for x in 0..2usize {
            let mut reg = s_acc[comptime!(nt * 2 + x)];
            let h = rows[comptime!(2 * x)];
            let i = rows[comptime!(2 * x + 1)];
            #[unroll]
            for e in 0..nc {
                let j = tile + comptime!(nt * 8 + e) + col0;
                let mut s = capped_logit(reg[e], scale, softcap, config) + bias_at(bias, b, h, i, j, config);
                if comptime!(masked) {
                    if !(valid[x] && j < end && visible(i, j, q_len, kv_len, window, config)) {
                        s = f32::new(MASKED);
                    }
                }
                if comptime!(x == 0) {
                    max0 = max0.max(s);
                } else {
                    max1 = max1.max(s);
                }
                reg[e] = s;
            }
            s_acc[comptime!(nt * 2 + x)] = reg;
        }
    }
    (max0, max1)
}

/// Turn this lane's logits into `exp(s − max)` in place (masked logits into 0) and return the
/// lane's partial sums of its two rows.
#[cube]
fn tile_probabilities<NC: Size>(s_acc: &mut Array<Vector<f32, NC>>, max0: f32, max1: f32, #[comptime] masked: bool) -> (f32, f32) {
    let nc = NC::value();
    let key_tiles = comptime!(TILE_KEYS / 8);
    let mut sum0 = 0.0f32;
    let mut sum1 = 0.0f32;
    #[unroll]
    for nt in 0..key_tiles {
        #[unroll]
        for x in 0..2usize {
            let mut reg = s_acc[comptime!(nt * 2 + x)];
            let max = if comptime!(x == 0) { max0 } else { max1 };
            #[unroll]
            for e in 0..nc {
                let mut p = fast_exp(reg[e] - max);
                if comptime!(masked) {
                    if reg[e] <= MASKED {
                        p = 0.0;
                    }
                }
                if comptime!(x == 0) {
                    sum0 += p;
                } else {
                    sum1 += p;
                }
                reg[e] = p;
            }
            s_acc[comptime!(nt * 2 + x)] = reg;
        }
    }
    (sum0, sum1)
}

/// Maximum over the four lanes of a quad (which together hold one accumulator row).
#[cube]
fn quad_max(x: f32) -> f32 {
    let y = x.max(plane_shuffle_xor(x, 1u32));
    y.max(plane_shuffle_xor(y, 2u32))
}

/// Sum over the four lanes of a quad.
#[cube]
fn quad_sum(x: f32) -> f32 {
    let y = x + plane_shuffle_xor(x, 1u32);
    y + plane_shuffle_xor(y, 2u32)
}

/// Grid as the portable forward (x = blocks of packed rows, y = kv head, z = batch) with
/// `planes × 16` rows per cube; cube `(32, planes)`. K and V need a unit last stride, other
/// strides that are multiples of 8 elements and 16-byte aligned starts (the host checks).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(super) fn mma_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    softcap: f32,
    window: usize,
    #[comptime] config: AttentionConfig,
    #[comptime] planes: usize,
    #[define(F)] _dtype: StorageType,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let d = config.head_dim;
    let k_steps = comptime!(d / 16);
    let d_tiles = comptime!(d / 8);
    let key_tiles = comptime!(TILE_KEYS / 8);
    let pv_steps = comptime!(TILE_KEYS / 16);
    let stride = comptime!(d + PAD);
    let tile_elems = comptime!(TILE_KEYS * (d + PAD));
    let threads = comptime!(planes * 32);
    let na = def.vector_size(MatrixIdent::A);
    let nb = def.vector_size(MatrixIdent::B);
    let nc = def.vector_size(MatrixIdent::Accumulator);
    let size!(NA) = na;
    let size!(NB) = nb;
    let size!(NC) = nc;
    let a_vectors = def.vectors_per_lane(MatrixIdent::A);
    let b_vectors = def.vectors_per_lane(MatrixIdent::B);
    let c_vectors = def.vectors_per_lane(MatrixIdent::Accumulator);
    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS_Y as usize;

    let q_heads = q.shape(1);
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let group = q_heads / k.shape(1);
    let kvh = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let head_base = kvh * group;
    let packed = group * q_len;
    let p0 = CUBE_POS_X as usize * comptime!(planes * PLANE_ROWS);
    let plane_p0 = p0 + plane * comptime!(PLANE_ROWS);
    let (i_lo, i_hi) = position_span(p0, cubecl::prelude::min(p0 + comptime!(planes * PLANE_ROWS), packed) - 1, q_len);
    let (start, end) = key_range(i_lo, i_hi, q_len, kv_len, window, config);
    let (free_lo, free_hi) = unmasked_keys(i_lo, i_hi, q_len, kv_len, window, start, end, config);

    // The two rows this lane holds in accumulators (vector x ↔ row x), and their first column.
    let (row0, col0) = def.position_of_nth(lane, 0u32, MatrixIdent::Accumulator);
    let (row1, _) = def.position_of_nth(lane, 2u32, MatrixIdent::Accumulator);
    let (valid0, h0, i0) = packed_row(plane_p0 + row0 as usize, packed, head_base, q_len);
    let (valid1, h1, i1) = packed_row(plane_p0 + row1 as usize, packed, head_base, q_len);
    let col0 = col0 as usize;
    let mut rows = Array::<usize>::new(4usize);
    rows[0] = h0;
    rows[1] = i0;
    rows[2] = h1;
    rows[3] = i1;
    let mut valid = Array::<bool>::new(2usize);
    valid[0] = valid0;
    valid[1] = valid1;

    // Q as A fragments, k-step by k-step (rows past the end are 0).
    let mut q_frags = Array::<Vector<F, NA>>::new(comptime!(k_steps * a_vectors));
    #[unroll]
    for ks in 0..k_steps {
        #[unroll]
        for vi in 0..a_vectors {
            let mut reg = Vector::<F, NA>::empty();
            #[unroll]
            for e in 0..na {
                let (r, c) = def.position_of_nth(lane, comptime!((vi * na + e) as u32), MatrixIdent::A);
                let (ok, h, i) = packed_row(plane_p0 + r as usize, packed, head_base, q_len);
                let mut value = F::new(0.0);
                if ok {
                    value = q[b * q.stride(0) + h * q.stride(1) + i * q.stride(2) + (comptime!(ks * 16) + c as usize) * q.stride(3)];
                }
                reg[e] = value;
            }
            q_frags[comptime!(ks * a_vectors + vi)] = reg;
        }
    }

    // `ldmatrix.x4`: lane l gives the address of row l % 8 of matrix l / 8. For Kᵀ the matrices
    // are (key tile 2p + m / 2, head-dim half m % 2); for V (key half m % 2, head-dim tile
    // 2p + m / 2); either way matrices 0, 1 and 2, 3 are the two B fragments of a product pair.
    let ld_row = (lane % 8) as usize;
    let ld_matrix = (lane / 8) as usize;
    let k_ld = ((ld_matrix / 2) * 8 + ld_row) * stride + (ld_matrix % 2) * 8;
    let v_ld = ((ld_matrix % 2) * 8 + ld_row) * stride + (ld_matrix / 2) * 8;

    let mut o_acc = Array::<Vector<f32, NC>>::new(comptime!(d_tiles * c_vectors));
    #[unroll]
    for x in 0..comptime!(d_tiles * c_vectors) {
        o_acc[x] = Vector::new(0.0);
    }
    let mut s_acc = Array::<Vector<f32, NC>>::new(comptime!(key_tiles * c_vectors));
    let mut a = Array::<Vector<F, NA>>::new(a_vectors);
    let mut bf = Array::<Vector<F, NB>>::new(b_vectors);
    let mut c_lo = Array::<Vector<f32, NC>>::new(c_vectors);
    let mut c_hi = Array::<Vector<f32, NC>>::new(c_vectors);
    let mut m0 = f32::new(MASKED);
    let mut m1 = f32::new(MASKED);
    let mut l0 = 0.0f32;
    let mut l1 = 0.0f32;

    // Buffer n (0 or 1) holds K at `2n · tile_elems` and V right after it.
    let mut smem = SharedMemory::<F>::new_aligned(comptime!(4 * tile_elems), 16usize);
    let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let k_base = b * k.stride(0) + kvh * k.stride(1);
    let v_base = b * v.stride(0) + kvh * v.stride(1);
    if start < end {
        stage_tile(k, &mut smem, 0usize, k_base, start, end, d, threads);
        stage_tile(v, &mut smem, tile_elems, v_base, start, end, d, threads);
    }
    barrier.commit_copy_async();
    barrier.arrive_and_wait();

    let mut tile = start;
    let mut buffer = 0usize;
    while tile < end {
        let next = tile + TILE_KEYS;
        if next < end {
            let other = (1 - buffer) * comptime!(2 * tile_elems);
            stage_tile(k, &mut smem, other, k_base, next, end, d, threads);
            stage_tile(v, &mut smem, other + tile_elems, v_base, next, end, d, threads);
        }
        let k_tile = buffer * comptime!(2 * tile_elems);
        let v_tile = k_tile + tile_elems;

        // S = Q Kᵀ, two 16×8 key tiles per `ldmatrix.x4`.
        #[unroll]
        for pair in 0..comptime!(key_tiles / 2) {
            #[unroll]
            for x in 0..c_vectors {
                c_lo[x] = Vector::new(0.0);
                c_hi[x] = Vector::new(0.0);
            }
            #[unroll]
            for ks in 0..k_steps {
                #[unroll]
                for vi in 0..a_vectors {
                    a[vi] = q_frags[comptime!(ks * a_vectors + vi)];
                }
                let at = k_tile + comptime!(pair * 16 * (d + PAD) + ks * 16) + k_ld;
                let regs = def.load_matrix::<F, NB>(&smem.slice(at, at + CHUNK), MatrixIdent::B, 4usize, false);
                bf[0] = regs[0];
                bf[1] = regs[1];
                def.execute_inplace(&a, &bf, &mut c_lo);
                bf[0] = regs[2];
                bf[1] = regs[3];
                def.execute_inplace(&a, &bf, &mut c_hi);
            }
            #[unroll]
            for x in 0..c_vectors {
                s_acc[comptime!(2 * pair * c_vectors + x)] = c_lo[x];
                s_acc[comptime!((2 * pair + 1) * c_vectors + x)] = c_hi[x];
            }
        }

        // Online softmax; the mask only where a tile crosses an edge.
        let masked = tile < free_lo || next > free_hi;
        let (max0, max1) = if masked {
            tile_logits::<F, NC>(&mut s_acc, bias, b, &rows, &valid, tile, col0, end, q_len, kv_len, window, scale, softcap, config, true)
        } else {
            tile_logits::<F, NC>(&mut s_acc, bias, b, &rows, &valid, tile, col0, end, q_len, kv_len, window, scale, softcap, config, false)
        };
        let new0 = m0.max(quad_max(max0));
        let new1 = m1.max(quad_max(max1));
        let alpha0 = fast_exp(m0 - new0);
        let alpha1 = fast_exp(m1 - new1);
        m0 = new0;
        m1 = new1;
        let (sum0, sum1) = if masked {
            tile_probabilities::<NC>(&mut s_acc, new0, new1, true)
        } else {
            tile_probabilities::<NC>(&mut s_acc, new0, new1, false)
        };
        // Each lane keeps its partial row sums; the quad adds them up once at the end.
        l0 = l0 * alpha0 + sum0;
        l1 = l1 * alpha1 + sum1;
        #[unroll]
        for dt in 0..d_tiles {
            o_acc[comptime!(dt * c_vectors)] = o_acc[comptime!(dt * c_vectors)] * Vector::new(alpha0);
            o_acc[comptime!(dt * c_vectors + 1)] = o_acc[comptime!(dt * c_vectors + 1)] * Vector::new(alpha1);
        }

        // O += P V: the probabilities of keys [16s, 16s + 16) are the A fragment of k-step s.
        #[unroll]
        for ps in 0..pv_steps {
            #[unroll]
            for vi in 0..a_vectors {
                let probabilities = s_acc[comptime!((2 * ps + vi / 2) * c_vectors + vi % 2)];
                let mut reg = Vector::<F, NA>::empty();
                #[unroll]
                for e in 0..na {
                    reg[e] = F::cast_from(probabilities[e]);
                }
                a[vi] = reg;
            }
            #[unroll]
            for pair in 0..comptime!(d_tiles / 2) {
                let at = v_tile + comptime!(ps * 16 * (d + PAD) + pair * 16) + v_ld;
                let regs = def.load_matrix::<F, NB>(&smem.slice(at, at + CHUNK), MatrixIdent::B, 4usize, true);
                #[unroll]
                for x in 0..c_vectors {
                    c_lo[x] = o_acc[comptime!(2 * pair * c_vectors + x)];
                    c_hi[x] = o_acc[comptime!((2 * pair + 1) * c_vectors + x)];
                }
                bf[0] = regs[0];
                bf[1] = regs[1];
                def.execute_inplace(&a, &bf, &mut c_lo);
                bf[0] = regs[2];
                bf[1] = regs[3];
                def.execute_inplace(&a, &bf, &mut c_hi);
                #[unroll]
                for x in 0..c_vectors {
                    o_acc[comptime!(2 * pair * c_vectors + x)] = c_lo[x];
                    o_acc[comptime!((2 * pair + 1) * c_vectors + x)] = c_hi[x];
                }
            }
        }
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
    let base0 = ((b * q_heads + h0) * q_len + i0) * d;
    let base1 = ((b * q_heads + h1) * q_len + i1) * d;
    #[unroll]
    for dt in 0..d_tiles {
        #[unroll]
        for e in 0..nc {
            let col = comptime!(dt * 8 + e) + col0;
            if valid0 {
                out[base0 + col] = F::cast_from(o_acc[comptime!(dt * c_vectors)][e] * inv0);
            }
            if valid1 {
                out[base1 + col] = F::cast_from(o_acc[comptime!(dt * c_vectors + 1)][e] * inv1);
            }
        }
    }
    if col0 == 0 {
        let mut value0 = f32::new(EMPTY_LSE);
        let mut value1 = f32::new(EMPTY_LSE);
        if l0 > 0.0 {
            value0 = m0 + l0.ln();
        }
        if l1 > 0.0 {
            value1 = m1 + l1.ln();
        }
        if valid0 {
            lse[(b * q_heads + h0) * q_len + i0] = value0;
        }
        if valid1 {
            lse[(b * q_heads + h1) * q_len + i1] = value1;
        }
    }
}
