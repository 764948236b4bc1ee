//! The flash attention forward on tensor cores (CUDA `mma.sync` m16n8k16, f16/bf16 in, f32
//! accumulate), FlashAttention-2 style: each plane owns 16 packed query rows and keeps its Q
//! fragments, scores, probabilities and output accumulators in registers; only K and V tiles go
//! through shared memory.
//!
//! Register layout of `mma.sync.m16n8k16` on CUDA, lane `= 4g + t`:
//! - accumulator (16×8 f32): vector `v` of the lane holds row `g + 8v`, columns `2t, 2t + 1`;
//! - A (16×16): vector `v` holds row `g + 8(v % 2)`, columns `2t + 8(v / 2)` and the next one.
//!
//! So the two accumulator tiles of keys `[16s, 16s + 8)` and `[16s + 8, 16s + 16)` are, vector
//! for vector, the A fragment of the next product's k-step `s`: the probabilities become the A
//! operand of `P·V` by a cast, without leaving registers. K is staged row-major and V
//! transposed in shared memory (rows padded by 8 elements against bank conflicts), so both B
//! fragments are pairs of adjacent elements. Fragment positions come from `position_of_nth`.

use super::{AttentionConfig, MASKED, EMPTY_LSE, bias_at, capped_logit, key_range, packed_row, position_span, visible};
use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

/// Rows one plane owns (the MMA's m).
pub(super) const PLANE_ROWS: usize = 16;
/// Planes per cube.
pub(super) const PLANES: usize = 4;
/// Keys per shared-memory tile.
pub(super) const TILE_KEYS: usize = 64;
/// Padding of shared-memory rows, in elements.
const PAD: usize = 8;

/// Shared memory of one cube, in bytes, for heads of `head_dim` and `elem_size`-byte elements.
pub(super) fn shared_bytes(head_dim: usize, elem_size: usize) -> usize {
    elem_size * (TILE_KEYS * (head_dim + PAD) + head_dim * (TILE_KEYS + PAD))
}

/// Grid as the portable forward (x = blocks of packed rows, y = kv head, z = batch) with
/// `PLANES × 16` rows per cube; cube `(plane size, PLANES)`.
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
    #[define(F)] _dtype: StorageType,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let d = config.head_dim;
    let k_steps = comptime!(d / 16);
    let d_tiles = comptime!(d / 8);
    let key_tiles = comptime!(TILE_KEYS / 8);
    let pv_steps = comptime!(TILE_KEYS / 16);
    let k_stride = comptime!(d + PAD);
    let v_stride = comptime!(TILE_KEYS + PAD);
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
    let p0 = CUBE_POS_X as usize * comptime!(PLANES * PLANE_ROWS);
    let plane_p0 = p0 + plane * comptime!(PLANE_ROWS);
    let (i_lo, i_hi) = position_span(p0, cubecl::prelude::min(p0 + comptime!(PLANES * PLANE_ROWS), packed) - 1, q_len);
    let (start, end) = key_range(i_lo, i_hi, q_len, kv_len, window, config);

    // The two rows this lane holds in accumulators (vector v ↔ row_v), and their columns.
    let (row0, col0) = def.position_of_nth(lane, 0u32, MatrixIdent::Accumulator);
    let (row1, _) = def.position_of_nth(lane, 2u32, MatrixIdent::Accumulator);
    let (valid0, h0, i0) = packed_row(plane_p0 + row0 as usize, packed, head_base, q_len);
    let (valid1, h1, i1) = packed_row(plane_p0 + row1 as usize, packed, head_base, q_len);

    // Q as A fragments, k-step by k-step.
    let mut q_frags = Array::<Vector<F, NA>>::new(comptime!(k_steps * a_vectors));
    #[unroll]
    for ks in 0..k_steps {
        #[unroll]
        for vi in 0..a_vectors {
            let mut reg = Vector::<F, NA>::empty();
            #[unroll]
            for e in 0..na {
                let (r, c) = def.position_of_nth(lane, comptime!((vi * na + e) as u32), MatrixIdent::A);
                let (valid, h, i) = packed_row(plane_p0 + r as usize, packed, head_base, q_len);
                let mut value = F::new(0.0);
                if valid {
                    value = q[b * q.stride(0) + h * q.stride(1) + i * q.stride(2) + (comptime!(ks * 16) + c as usize) * q.stride(3)];
                }
                reg[e] = value;
            }
            q_frags[comptime!(ks * a_vectors + vi)] = reg;
        }
    }
    // Where this lane's B elements sit in a K row / V column (k index, n index).
    let mut b_k = Array::<u32>::new(comptime!(b_vectors * nb));
    let mut b_n = Array::<u32>::new(comptime!(b_vectors * nb));
    #[unroll]
    for n in 0..comptime!(b_vectors * nb) {
        let (kk, nn) = def.position_of_nth(lane, comptime!(n as u32), MatrixIdent::B);
        b_k[n] = kk;
        b_n[n] = nn;
    }

    let mut o_acc = Array::<Vector<f32, NC>>::new(comptime!(d_tiles * c_vectors));
    #[unroll]
    for x in 0..comptime!(d_tiles * c_vectors) {
        o_acc[x] = Vector::new(0.0);
    }
    let mut s_acc = Array::<Vector<f32, NC>>::new(comptime!(key_tiles * c_vectors));
    let mut a = Array::<Vector<F, NA>>::new(a_vectors);
    let mut bf = Array::<Vector<F, NB>>::new(b_vectors);
    let mut c = Array::<Vector<f32, NC>>::new(c_vectors);
    let mut m0 = f32::new(MASKED);
    let mut m1 = f32::new(MASKED);
    let mut l0 = 0.0f32;
    let mut l1 = 0.0f32;

    let mut k_tile = SharedMemory::<F>::new(comptime!(TILE_KEYS * k_stride));
    let mut v_tile = SharedMemory::<F>::new(comptime!(d * v_stride));
    let mut tile = start;
    while tile < end {
        sync_cube();
        // Stage K row-major and V transposed; keys past `end` are 0.
        let mut t = UNIT_POS as usize;
        while t < comptime!(TILE_KEYS * d) {
            let key = t / d;
            let col = t % d;
            let j = tile + key;
            let mut kv = F::new(0.0);
            let mut vv = F::new(0.0);
            if j < end {
                kv = k[b * k.stride(0) + kvh * k.stride(1) + j * k.stride(2) + col * k.stride(3)];
                vv = v[b * v.stride(0) + kvh * v.stride(1) + j * v.stride(2) + col * v.stride(3)];
            }
            k_tile[key * k_stride + col] = kv;
            v_tile[col * v_stride + key] = vv;
            t += comptime!(PLANES * 32);
        }
        sync_cube();

        // S = Q Kᵀ, one 16×8 tile of keys at a time.
        #[unroll]
        for nt in 0..key_tiles {
            #[unroll]
            for x in 0..c_vectors {
                c[x] = Vector::new(0.0);
            }
            #[unroll]
            for ks in 0..k_steps {
                #[unroll]
                for vi in 0..a_vectors {
                    a[vi] = q_frags[comptime!(ks * a_vectors + vi)];
                }
                #[unroll]
                for vi in 0..b_vectors {
                    let mut reg = Vector::<F, NB>::empty();
                    #[unroll]
                    for e in 0..nb {
                        let n = comptime!(vi * nb + e);
                        reg[e] = k_tile[(comptime!(nt * 8) + b_n[n] as usize) * k_stride + comptime!(ks * 16) + b_k[n] as usize];
                    }
                    bf[vi] = reg;
                }
                def.execute_inplace(&a, &bf, &mut c);
            }
            #[unroll]
            for x in 0..c_vectors {
                s_acc[comptime!(nt * c_vectors + x)] = c[x];
            }
        }

        // Logits, masks and the running maximum of both rows.
        let mut max0 = f32::new(MASKED);
        let mut max1 = f32::new(MASKED);
        #[unroll]
        for nt in 0..key_tiles {
            #[unroll]
            for x in 0..c_vectors {
                let mut reg = s_acc[comptime!(nt * c_vectors + x)];
                #[unroll]
                for e in 0..nc {
                    let j = tile + comptime!(nt * 8 + e) + col0 as usize;
                    let mut s = f32::new(MASKED);
                    if comptime!(x == 0) {
                        if valid0 && j < end && visible(i0, j, q_len, kv_len, window, config) {
                            s = capped_logit(reg[e], scale, softcap, config) + bias_at(bias, b, h0, i0, j, config);
                            max0 = max0.max(s);
                        }
                    } else {
                        if valid1 && j < end && visible(i1, j, q_len, kv_len, window, config) {
                            s = capped_logit(reg[e], scale, softcap, config) + bias_at(bias, b, h1, i1, j, config);
                            max1 = max1.max(s);
                        }
                    }
                    reg[e] = s;
                }
                s_acc[comptime!(nt * c_vectors + x)] = reg;
            }
        }
        // A row is spread over the four lanes of a quad.
        max0 = max0.max(plane_shuffle_xor(max0, 1u32));
        max0 = max0.max(plane_shuffle_xor(max0, 2u32));
        max1 = max1.max(plane_shuffle_xor(max1, 1u32));
        max1 = max1.max(plane_shuffle_xor(max1, 2u32));
        let new0 = m0.max(max0);
        let new1 = m1.max(max1);
        let alpha0 = (m0 - new0).exp();
        let alpha1 = (m1 - new1).exp();
        m0 = new0;
        m1 = new1;

        let mut sum0 = 0.0f32;
        let mut sum1 = 0.0f32;
        #[unroll]
        for nt in 0..key_tiles {
            #[unroll]
            for x in 0..c_vectors {
                let mut reg = s_acc[comptime!(nt * c_vectors + x)];
                #[unroll]
                for e in 0..nc {
                    let mut p = 0.0f32;
                    if comptime!(x == 0) {
                        if reg[e] > MASKED {
                            p = (reg[e] - new0).exp();
                        }
                        sum0 += p;
                    } else {
                        if reg[e] > MASKED {
                            p = (reg[e] - new1).exp();
                        }
                        sum1 += p;
                    }
                    reg[e] = p;
                }
                s_acc[comptime!(nt * c_vectors + x)] = reg;
            }
        }
        sum0 += plane_shuffle_xor(sum0, 1u32);
        sum0 += plane_shuffle_xor(sum0, 2u32);
        sum1 += plane_shuffle_xor(sum1, 1u32);
        sum1 += plane_shuffle_xor(sum1, 2u32);
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
            for dt in 0..d_tiles {
                #[unroll]
                for vi in 0..b_vectors {
                    let mut reg = Vector::<F, NB>::empty();
                    #[unroll]
                    for e in 0..nb {
                        let n = comptime!(vi * nb + e);
                        reg[e] = v_tile[(comptime!(dt * 8) + b_n[n] as usize) * v_stride + comptime!(ps * 16) + b_k[n] as usize];
                    }
                    bf[vi] = reg;
                }
                #[unroll]
                for x in 0..c_vectors {
                    c[x] = o_acc[comptime!(dt * c_vectors + x)];
                }
                def.execute_inplace(&a, &bf, &mut c);
                #[unroll]
                for x in 0..c_vectors {
                    o_acc[comptime!(dt * c_vectors + x)] = c[x];
                }
            }
        }
        tile += TILE_KEYS;
    }

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
            let col = comptime!(dt * 8 + e) + col0 as usize;
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
