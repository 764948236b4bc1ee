//! Flash attention on tensor cores (CUDA `mma.sync` m16n8k16, f16/bf16 in, f32 accumulate),
//! FlashAttention-2 style: the forward ([`forward`]) and the backward ([`backward`]) share the
//! fragment plumbing of this module.
//!
//! Register layout of `mma.sync.m16n8k16` on CUDA, lane `= 4g + t`:
//! - accumulator (16×8 f32): vector `v` of the lane holds row `g + 8v`, columns `2t, 2t + 1`;
//! - A (16×16): vector `v` holds row `g + 8(v % 2)`, columns `2t + 8(v / 2)` and the next one;
//! - B (16×8): vector `v` holds column `g`, rows `2t + 8v` and the next one.
//!
//! So the two accumulator tiles of columns `[16s, 16s + 8)` and `[16s + 8, 16s + 16)` are, vector
//! for vector, the A fragment of k-step `s` of the next product: probabilities and logit
//! gradients become A operands by a cast, without leaving registers.
//!
//! Data movement:
//! - Tiles of 64 rows arrive by 16-byte `cp.async` copies into two shared-memory buffers: the
//!   copies of tile `n + 1` fly while tile `n` is computed, and one mbarrier wait per tile both
//!   lands them and tells every plane that the other buffer is free again.
//! - Tiles stay row-major (one key or query per row, rows padded by 16 bytes, which puts the
//!   eight rows of an `ldmatrix` on distinct banks). `ldmatrix.x4` reads a row-major tile as the
//!   B fragments of `X·Tileᵀ` ([`scores`]) or, transposed, of `P·Tile` ([`accumulate`]).

pub(super) mod backward;
pub(super) mod forward;

use super::{AttentionConfig, key_range, packed_row, position_span, visible};
use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::{copy_async, copy_async_checked};
use cubecl::prelude::*;

/// Rows one plane owns (the MMA's m).
pub(super) const PLANE_ROWS: usize = 16;
/// Rows (keys, or queries in the backward) per streamed shared-memory tile.
pub(super) const TILE: usize = 64;
/// Padding of shared-memory rows, in elements (16 bytes).
const PAD: usize = 8;
/// Elements per 16-byte copy.
const CHUNK: usize = 8;

/// Shared memory the larger of the kernels (the backward's: K and V of its keys, two buffers of
/// Q and dO tiles, two `TILE × keys` blocks of dS, statistics) needs per cube, in bytes, for
/// heads of `head_dim`, `elem_size`-byte elements and `planes` planes.
pub(super) fn shared_bytes(head_dim: usize, elem_size: usize, planes: usize) -> usize {
    let streamed = 4 * tile_elems(TILE, head_dim);
    let keys = 2 * tile_elems(planes * PLANE_ROWS, head_dim);
    let ds = 2 * tile_elems(TILE, planes * PLANE_ROWS);
    let barrier_and_stats = 64 + 4 * 4 * TILE;
    elem_size * (streamed + keys + ds) + barrier_and_stats
}

/// Elements of one padded `rows × head_dim` tile.
pub(super) const fn tile_elems(rows: usize, head_dim: usize) -> usize {
    rows * (head_dim + PAD)
}

/// The `mma.sync` shape every kernel here uses.
#[cube]
pub(super) fn mma_shape<F: Float>() -> MmaDefinition<F, F, f32> {
    MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize)
}

/// `log2 e`: the softmax runs in base 2, so that a logit's scale, its row's maximum and the change
/// of base fold into one multiply-add ahead of the exponential.
pub(super) const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// `2^x` through the hardware approximation (`ex2.approx`): fast-math `powf` of the constant
/// base 2, which NVRTC folds into one `MUFU.EX2` (plus the denormal fix-up NVRTC adds without
/// `-ftz`). CubeCL's fast `exp` is `__expf`, one multiply by `log2 e` more per value. The
/// relative error (~1e-6 over the range of `s − max`) is far below the bf16/f16 rounding of the
/// probabilities it feeds.
#[cube(fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
pub(super) fn fast_exp2(x: f32) -> f32 {
    f32::powf(2.0f32, x)
}

/// Maximum over the four lanes of a quad (which together hold one accumulator row).
#[cube]
pub(super) fn quad_max(x: f32) -> f32 {
    let y = x.max(plane_shuffle_xor(x, 1u32));
    y.max(plane_shuffle_xor(y, 2u32))
}

/// Sum over the four lanes of a quad.
#[cube]
pub(super) fn quad_sum(x: f32) -> f32 {
    let y = x + plane_shuffle_xor(x, 1u32);
    y + plane_shuffle_xor(y, 2u32)
}

/// This lane's `ldmatrix.x4` row address, relative to a 16×16 block of a row-major tile, for the
/// B fragments of `X·Tileᵀ`: matrix `m` is (row tile `m / 2`, column half `m % 2`), so matrices
/// 0, 1 and 2, 3 are the B fragments of two neighbouring 8-row tiles.
#[cube]
pub(super) fn ld_rows_by_halves(#[comptime] d: usize) -> usize {
    let lane = UNIT_POS_PLANE as usize;
    let m = lane / 8;
    ((m / 2) * 8 + lane % 8) * comptime!(d + PAD) + (m % 2) * 8
}

/// This lane's `ldmatrix.x4` row address for a 16×16 block read as the A fragment of a
/// row-major tile, or (transposed) as the B fragments of `P·Tile` for two neighbouring 8-column
/// tiles: matrix `m` is (row half `m % 2`, column tile `m / 2`).
#[cube]
pub(super) fn ld_halves_by_columns(#[comptime] d: usize) -> usize {
    let lane = UNIT_POS_PLANE as usize;
    let m = lane / 8;
    ((m % 2) * 8 + lane % 8) * comptime!(d + PAD) + (m / 2) * 8
}

/// Issue the `cp.async` copies of rows `[first, first + rows)` of `src` (row `r` at
/// `base + r · row_stride`, unit last stride) into the padded tile at `dst`; rows at or past
/// `end` are zero-filled. Every unit of the cube takes part. Callers read `row_stride` once,
/// outside their tile loops: read here, its load stalled every tile.
///
/// A tile that lies wholly before `end` takes the lean path when the cube's units cover whole
/// rows: each unit copies one 16-byte column of every `threads / chunks`-th row, so its
/// addresses advance by a constant and no copy needs a bound or a zero fill. The bounded path
/// costs about 20 instructions a copy, which in the forward was a third of all it issued.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn stage_tile<F: Float>(
    src: &Tensor<F>,
    smem: &mut SharedMemory<F>,
    dst: usize,
    base: usize,
    row_stride: usize,
    first: usize,
    end: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] threads: usize,
) {
    let chunks = comptime!(d / CHUNK);
    if comptime!(threads.is_multiple_of(chunks)) {
        if first + rows <= end {
            let step = comptime!(threads / chunks);
            let r0 = UNIT_POS as usize / chunks;
            let col = (UNIT_POS as usize % chunks) * CHUNK;
            let to = dst + r0 * comptime!(d + PAD) + col;
            let jump = row_stride * step;
            let mut from = base + (first + r0) * row_stride + col;
            #[unroll]
            for i in 0..comptime!(rows.div_ceil(step)) {
                let at = to + comptime!(i * step * (d + PAD));
                // Only a last, partial round of rows needs to check that its row exists.
                if comptime!((i + 1) * step <= rows) || r0 + comptime!(i * step) < rows {
                    copy_async(&src.slice(from, from + CHUNK), &mut smem.slice_mut(at, at + CHUNK), comptime!(CHUNK as u32));
                }
                from += jump;
            }
        } else {
            stage_rows_bounded(src, smem, dst, base, row_stride, first, end, rows, d, threads);
        }
    } else {
        stage_rows_bounded(src, smem, dst, base, row_stride, first, end, rows, d, threads);
    }
}

/// [`stage_tile`] for any tile: 16-byte chunk `c` of the tile goes to unit `c % threads`, and
/// rows at or past `end` are zero-filled.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows_bounded<F: Float>(
    src: &Tensor<F>,
    smem: &mut SharedMemory<F>,
    dst: usize,
    base: usize,
    row_stride: usize,
    first: usize,
    end: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] threads: usize,
) {
    let chunks = comptime!(d / CHUNK);
    let total = comptime!(rows * d / CHUNK);
    let stride = comptime!(d + PAD);
    let mut c = UNIT_POS as usize;
    #[unroll]
    for _ in 0..comptime!(total.div_ceil(threads)) {
        if c < total {
            let row = c / chunks;
            let col = (c % chunks) * CHUNK;
            let mut src_row = first + row;
            let mut len = comptime!(CHUNK).runtime();
            if src_row >= end {
                // Nothing is read; the copy zero-fills, from a row that exists.
                src_row = first;
                len = 0usize;
            }
            let from = base + src_row * row_stride + col;
            let to = dst + row * stride + col;
            copy_async_checked(&src.slice(from, from + len), &mut smem.slice_mut(to, to + CHUNK), comptime!(CHUNK as u32));
        }
        c += threads;
    }
}

/// First of the two accumulator columns this lane holds in every 8-column tile (`2t`).
#[cube]
pub(super) fn lane_column() -> usize {
    (UNIT_POS_PLANE % 4 * 2) as usize
}

/// Issue the copies of rows `[first, first + TILE)` of two tensors read together (K and V, or Q
/// and dO; rows from `a_base` and `b_base`, `a_stride` and `b_stride` apart) into the buffer at
/// `dst`: `a`'s tile, then `b`'s `tile_elems(TILE, d)` further.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn stage_pair<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    smem: &mut SharedMemory<F>,
    dst: usize,
    a_base: usize,
    b_base: usize,
    a_stride: usize,
    b_stride: usize,
    first: usize,
    end: usize,
    #[comptime] d: usize,
    #[comptime] threads: usize,
) {
    stage_tile(a, smem, dst, a_base, a_stride, first, end, TILE, d, threads);
    stage_tile(b, smem, dst + comptime!(tile_elems(TILE, d)), b_base, b_stride, first, end, TILE, d, threads);
}

/// Write this lane's two accumulator rows (`d / 8` tiles) times `factor0`/`factor1` to rows
/// `row0`/`row1` of the contiguous, `d`-wide `out`; a row whose `write` flag is false is skipped.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_rows<O: Float, NC: Size>(
    out: &mut Tensor<O>,
    acc: &Array<Vector<f32, NC>>,
    row0: usize,
    row1: usize,
    write0: bool,
    write1: bool,
    factor0: f32,
    factor1: f32,
    #[comptime] d: usize,
) {
    let nc = NC::value();
    let col0 = lane_column();
    #[unroll]
    for dt in 0..comptime!(d / 8) {
        #[unroll]
        for e in 0..nc {
            let col = comptime!(dt * 8 + e) + col0;
            if write0 {
                out[row0 * d + col] = O::cast_from(acc[comptime!(dt * 2)][e] * factor0);
            }
            if write1 {
                out[row1 * d + col] = O::cast_from(acc[comptime!(dt * 2 + 1)][e] * factor1);
            }
        }
    }
}

/// The A fragments (k-step by k-step over `d`) of the 16 packed rows from `plane_p0` of `src`
/// (`[batch, heads, len, d]`, packed row `p` = head `head_base + p / len`, position `p % len`);
/// rows past `packed` are 0. A lane's fragments come from two rows (`g` and `g + 8` of the 16),
/// so their offsets are computed once, not per element (per element they were divisions and
/// stride products repeated 64 times per lane at d = 128, in a prologue every split runs).
#[cube]
pub(super) fn row_fragments<F: Float, NA: Size>(
    src: &Tensor<F>,
    b: usize,
    head_base: usize,
    plane_p0: usize,
    packed: usize,
    #[comptime] d: usize,
) -> Array<Vector<F, NA>> {
    let def = mma_shape::<F>();
    let na = NA::value();
    let a_vectors = def.vectors_per_lane(MatrixIdent::A);
    let len = src.shape(2);
    let lane = UNIT_POS_PLANE;
    let g = (lane / 4) as usize;
    let (ok0, h0, i0) = packed_row(plane_p0 + g, packed, head_base, len);
    let (ok1, h1, i1) = packed_row(plane_p0 + g + 8, packed, head_base, len);
    let batch = b * src.stride(0);
    let base0 = batch + h0 * src.stride(1) + i0 * src.stride(2);
    let base1 = batch + h1 * src.stride(1) + i1 * src.stride(2);
    let column_stride = src.stride(3);
    let mut frags = Array::<Vector<F, NA>>::new(comptime!(d / 16 * a_vectors));
    #[unroll]
    for ks in 0..comptime!(d / 16) {
        #[unroll]
        for vi in 0..a_vectors {
            let mut reg = Vector::<F, NA>::empty();
            #[unroll]
            for e in 0..na {
                let (r, c) = def.position_of_nth(lane, comptime!((vi * na + e) as u32), MatrixIdent::A);
                // `r` is `g` or `g + 8`.
                let upper = (r as usize) < 8;
                let ok = if upper { ok0 } else { ok1 };
                let base = if upper { base0 } else { base1 };
                let mut value = F::new(0.0);
                if ok {
                    value = src[base + (comptime!(ks * 16) + c as usize) * column_stride];
                }
                reg[e] = value;
            }
            frags[comptime!(ks * a_vectors + vi)] = reg;
        }
    }
    frags
}

/// The two products of one `ldmatrix.x4` (transposed for `P·Tile`): B fragments of two
/// neighbouring 8-column tiles read from `at`, multiplied by `a` into accumulator tiles
/// `2 · pair` and `2 · pair + 1` of `acc`.
#[cube]
fn mma_pair<F: Float, NA: Size, NB: Size, NC: Size>(
    a: &Array<Vector<F, NA>>,
    smem: &SharedMemory<F>,
    at: usize,
    acc: &mut Array<Vector<f32, NC>>,
    #[comptime] pair: usize,
    #[comptime] transposed: bool,
) {
    let def = mma_shape::<F>();
    let mut regs = Array::<Vector<F, NB>>::new(4usize);
    let mut bf = Array::<Vector<F, NB>>::new(2usize);
    let mut c_lo = Array::<Vector<f32, NC>>::new(2usize);
    let mut c_hi = Array::<Vector<f32, NC>>::new(2usize);
    def.load_matrix_inplace::<F, NB>(&smem.slice(at, at + CHUNK), &mut regs, MatrixIdent::B, 4usize, transposed);
    #[unroll]
    for x in 0..2usize {
        c_lo[x] = acc[comptime!(4 * pair + x)];
        c_hi[x] = acc[comptime!(4 * pair + 2 + x)];
    }
    bf[0] = regs[0];
    bf[1] = regs[1];
    def.execute_inplace(a, &bf, &mut c_lo);
    bf[0] = regs[2];
    bf[1] = regs[3];
    def.execute_inplace(a, &bf, &mut c_hi);
    #[unroll]
    for x in 0..2usize {
        acc[comptime!(4 * pair + x)] = c_lo[x];
        acc[comptime!(4 * pair + 2 + x)] = c_hi[x];
    }
}

/// Read into `a` the A fragment of k-step `ks` of a row-major block in shared memory; `at` is
/// the block's start plus this lane's [`ld_halves_by_columns`] address.
#[cube]
fn load_a_shared<F: Float, NA: Size>(smem: &SharedMemory<F>, at: usize, a: &mut Array<Vector<F, NA>>, #[comptime] ks: usize) {
    let def = mma_shape::<F>();
    let from = at + comptime!(ks * 16);
    def.load_matrix_inplace::<F, NA>(&smem.slice(from, from + CHUNK), a, MatrixIdent::A, 4usize, false);
}

/// `acc = X · Tileᵀ` for one plane (16-bit inputs: four A and two B registers per lane): X is 16 rows × `d` (A fragments in `a_regs`, or, with
/// `a_shared`, read by `ldmatrix` from the row-major block at `a_at`), the tile the `TILE`
/// rows × `d` at `b_tile`. `acc` gets `TILE / 8` accumulator tiles (two vectors each).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn scores<F: Float, NA: Size, NB: Size, NC: Size>(
    a_regs: &Array<Vector<F, NA>>,
    smem: &SharedMemory<F>,
    a_at: usize,
    b_tile: usize,
    acc: &mut Array<Vector<f32, NC>>,
    #[comptime] d: usize,
    #[comptime] a_shared: bool,
) {
    let b_ld = ld_rows_by_halves(d);
    let a_ld = ld_halves_by_columns(d);
    let mut a = Array::<Vector<F, NA>>::new(4usize);
    clear::<NC>(acc, comptime!(TILE / 8));
    // k-steps outermost: each A fragment is read once, and the `TILE / 8` accumulator tiles of a
    // k-step are independent products the tensor cores can overlap (a k-step-inner order chains
    // every product on the previous one).
    #[unroll]
    for ks in 0..comptime!(d / 16) {
        if comptime!(a_shared) {
            load_a_shared::<F, NA>(smem, a_at + a_ld, &mut a, ks);
        } else {
            #[unroll]
            for vi in 0..4usize {
                a[vi] = a_regs[comptime!(ks * 4 + vi)];
            }
        }
        #[unroll]
        for pair in 0..comptime!(TILE / 16) {
            let at = b_tile + comptime!(pair * 16 * (d + PAD) + ks * 16) + b_ld;
            mma_pair::<F, NA, NB, NC>(&a, smem, at, acc, pair, false);
        }
    }
}

/// `out += A · Tile` for one plane (16-bit inputs: four A and two B registers per lane), A 16
/// rows × `a_width` columns: either `p` in accumulator layout (`a_width / 8` tiles, cast to `F`
/// as A fragments: probabilities and logit gradients never leave registers), or, with
/// `a_shared`, the row-major block at `a_at` (rows `a_width + PAD` apart) read by `ldmatrix`. The
/// tile holds `a_width` rows × `width` columns at `b_tile` (rows `d + PAD` apart); `out` holds
/// `width / 8` accumulator tiles.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn accumulate<F: Float, NA: Size, NB: Size, NC: Size>(
    p: &Array<Vector<f32, NC>>,
    smem: &SharedMemory<F>,
    a_at: usize,
    b_tile: usize,
    out: &mut Array<Vector<f32, NC>>,
    #[comptime] a_shared: bool,
    #[comptime] a_width: usize,
    #[comptime] width: usize,
    #[comptime] d: usize,
) {
    let na = NA::value();
    let a_ld = ld_halves_by_columns(a_width);
    let b_ld = ld_halves_by_columns(d);
    let mut a = Array::<Vector<F, NA>>::new(4usize);
    #[unroll]
    for ks in 0..comptime!(a_width / 16) {
        if comptime!(a_shared) {
            load_a_shared::<F, NA>(smem, a_at + a_ld, &mut a, ks);
        } else {
            #[unroll]
            for vi in 0..4usize {
                // A vector vi of k-step ks: row vi % 2 of accumulator tile 2ks + vi / 2.
                let values = p[comptime!((2 * ks + vi / 2) * 2 + vi % 2)];
                let mut reg = Vector::<F, NA>::empty();
                #[unroll]
                for e in 0..na {
                    reg[e] = F::cast_from(values[e]);
                }
                a[vi] = reg;
            }
        }
        #[unroll]
        for pair in 0..comptime!(width / 16) {
            let at = b_tile + comptime!(ks * 16 * (d + PAD) + pair * 16) + b_ld;
            mma_pair::<F, NA, NB, NC>(&a, smem, at, out, pair, true);
        }
    }
}

/// Zeroed accumulators: `tiles` 16×8 tiles (two vectors each).
#[cube]
pub(super) fn zeros<NC: Size>(#[comptime] tiles: usize) -> Array<Vector<f32, NC>> {
    let mut acc = Array::<Vector<f32, NC>>::new(comptime!(2 * tiles));
    clear::<NC>(&mut acc, tiles);
    acc
}

/// Zero the first `tiles` 16×8 accumulator tiles of `acc`.
#[cube]
pub(super) fn clear<NC: Size>(acc: &mut Array<Vector<f32, NC>>, #[comptime] tiles: usize) {
    #[unroll]
    for x in 0..comptime!(2 * tiles) {
        acc[x] = Vector::new(0.0);
    }
}

/// Whether query `i` sees key `j` and both exist (`i < q_end`, `j < k_end`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn pair_visible(i: usize, j: usize, q_end: usize, k_end: usize, q_len: usize, kv_len: usize, window: usize, #[comptime] config: AttentionConfig) -> bool {
    i < q_end && j < k_end && visible(i, j, q_len, kv_len, window, config)
}

/// Keys `[lo, hi)` that every query position in `[i_lo, i_hi]` sees, within `[start, end)`:
/// key tiles inside need no mask.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn unmasked_keys(i_lo: usize, i_hi: usize, q_len: usize, kv_len: usize, window: usize, start: usize, end: usize, #[comptime] config: AttentionConfig) -> (usize, usize) {
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

/// The forward's cube: `planes × 16` packed query rows of one kv head, and the
/// keys of one KV split.
#[derive(CubeType)]
pub(super) struct RowBlock {
    pub b: usize,
    /// KV split of this cube (0 without splits).
    pub split: usize,
    pub kvh: usize,
    pub head_base: usize,
    pub packed: usize,
    /// First packed row of this plane.
    pub plane_p0: usize,
    /// Keys `[start, end)` some row sees, and `[free_lo, free_hi)` all rows see.
    pub start: usize,
    pub end: usize,
    pub free_lo: usize,
    pub free_hi: usize,
}

/// Locate this cube's rows. Grid: x = blocks of `planes × 16` packed rows, y = kv head,
/// z = batch × `splits` (split fastest; split `s` takes keys `[s · split_len, (s + 1) · split_len)`):
/// cubes that run together share their K/V in L2. For causal attention the blocks run in reverse,
/// so that within a head the longest rows start first and the short ones fill in.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn row_block(
    q_heads: usize,
    q_len: usize,
    kv_heads: usize,
    kv_len: usize,
    window: usize,
    splits: usize,
    split_len: usize,
    #[comptime] config: AttentionConfig,
    #[comptime] planes: usize,
) -> RowBlock {
    let group = q_heads / kv_heads;
    let kvh = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize / splits;
    let split = CUBE_POS_Z as usize % splits;
    let mut block = CUBE_POS_X as usize;
    if comptime!(config.causal) {
        block = CUBE_COUNT_X as usize - 1 - block;
    }
    let packed = group * q_len;
    let p0 = block * comptime!(planes * PLANE_ROWS);
    let (i_lo, i_hi) = position_span(p0, cubecl::prelude::min(p0 + comptime!(planes * PLANE_ROWS), packed) - 1, q_len);
    let (mut start, mut end) = key_range(i_lo, i_hi, q_len, kv_len, window, config);
    start = cubecl::prelude::max(start, split * split_len);
    end = cubecl::prelude::min(end, split * split_len + split_len);
    let (free_lo, free_hi) = unmasked_keys(i_lo, i_hi, q_len, kv_len, window, start, end, config);
    RowBlock {
        b,
        split,
        kvh,
        head_base: kvh * group,
        packed,
        plane_p0: p0 + UNIT_POS_Y as usize * PLANE_ROWS,
        start,
        end,
        free_lo,
        free_hi,
    }
}
