// Flash attention backward on Hopper's warpgroup MMA (wgmma), f16/bf16 in, f32 accumulate.
//
// The gradients of `forward.cu`'s problem (no softcap, bias or window; bottom-right causal
// alignment), recomputing the probabilities from the forward's log-sum-exp as `mma/backward.rs`
// does, with its five products per query tile:
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ                      (both operands in shared memory)
//   Pᵀ = exp(scale·Sᵀ − lse), dSᵀ = Pᵀ ∘ (dPᵀ − D)  (registers; D = Σ dO·O per query)
//   dV += Pᵀ·dO, dK += dSᵀ·Q                     (A straight from the registers)
//   dQ += scale · dS·K                           (dSᵀ through shared memory, atomics into f32)
//
// Compile-time parameters, defined before this source:
//   KILN_D          head dim, 64 or 128
//   KILN_CAUSAL     0 or 1
//   KILN_WGMMA_TYPE "bf16" or "f16", KILN_F16 0 or 1 (the same choice)
//
// Work of one cube: one (batch, kv head) and 128 keys, two warpgroups of 64 keys each. It walks
// every query head of the group and every 64-query tile that sees one of its keys, keeping dK
// and dV in registers (so GQA's gradients sum there) and staging the next tile's Q, dO, lse and D
// with `cp.async` while it computes this one. The two warpgroups split the dQ product by
// columns: warpgroup w adds `dS·K[:, w·d/2 ..]` for all 128 keys of the cube, so every dQ element
// gets one atomic add per cube and tile.
//
// Shared-memory tiles are swizzled as `common.cuh` describes; `dSᵀ` is kept as `[key][query]`
// (query-contiguous), which is the M-major A operand of `dS·K`.

// kiln places `hopper/common.cuh`, `hopper/wgmma.cuh` (the generated MMA wrappers) and this
// folder's `common.cuh` before this source.

#define BC 128                 // keys per cube
#define BR 64                  // queries per tile
#define THREADS 256
#define DQ_N (KILN_D / 2)      // dQ columns per warpgroup
#define S_REGS 32              // a warpgroup's 64 keys × 64 queries
#define KV_REGS (KILN_D / 2)   // a warpgroup's 64 keys × d
#define DQ_REGS (DQ_N / 2)
#define TILE_KV_BYTES (BC * KILN_D * 2)
#define TILE_Q_BYTES (BR * KILN_D * 2)
#define TILE_DS_BYTES (BC * BR * 2)
#define STATS_BYTES (2 * BR * 4)  // lse and D of one tile's queries
#define LOG2_E 1.4426950408889634f
#define POS_INF __int_as_float(0x7f800000)

// Bytes of dynamic shared memory the launch must request: K and V, two stages of (Q, dO), dSᵀ,
// two stages of (lse, D), and 1 KB for alignment.
#define KILN_SHARED_BYTES (2 * TILE_KV_BYTES + 4 * TILE_Q_BYTES + TILE_DS_BYTES + 2 * STATS_BYTES + 1024)

#if KILN_D == 64
#define WGMMA_KV wgmma_rs_n64
#define WGMMA_DQ wgmma_ss_mn_n32
#else
#define WGMMA_KV wgmma_rs_n128
#define WGMMA_DQ wgmma_ss_mn_n64
#endif

// Scalars of a launch (CubeCL passes them as one struct by value, after the buffers).
struct BackwardInfo {
    u32 q_heads, group, q_len, kv_len;
    RowStrides q, k, v, d_out;
    RowStrides kv_grads;  // of dk and dv (one layout)
    float scale;       // softmax scale
    float scale_log2;  // softmax scale · log2(e)
};

// dst[0..2] += (a, b) in global memory, one vector atomic.
__device__ __forceinline__ void add2(float* dst, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
}

// The query tiles of one key block: `first` is the first tile with a key of the block in view,
// `count` how many follow (per query head), and tiles before `masked_end` need the mask (the
// causal diagonal crosses them, or the block holds keys past `kv_len`).
struct TileRange {
    int first, count, masked_end;
};

__device__ __forceinline__ TileRange tile_range(int key0, const BackwardInfo& p) {
    const int tiles = (p.q_len + BR - 1) / BR;
    TileRange r = {0, tiles, 0};
#if KILN_CAUSAL
    // Query i sees key j when j <= i + kv_len - q_len.
    const int offset = (int)p.kv_len - (int)p.q_len;
    r.first = min(tiles, max(0, key0 - offset) / BR);
    r.count = tiles - r.first;
    r.masked_end = min(tiles, max(0, key0 + BC - 1 - offset + BR - 1) / BR);
#endif
    if (key0 + BC > (int)p.kv_len) r.masked_end = tiles;
    return r;
}

// Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for this warpgroup's 64 keys (issued and awaited).
__device__ __forceinline__ void scores_and_grads(float (&s)[S_REGS], float (&dp)[S_REGS], u32 k_tile, u32 v_tile, u32 q_tile, u32 do_tile) {
    const u32 rows = (threadIdx.x / 128) * (64 * 128);
    wgmma_fence();
    #pragma unroll
    for (int t = 0; t < KILN_D / 16; ++t) {
        const u32 a = (t / 4) * (BC * 128) + rows + (t % 4) * 32, b = (t / 4) * (BR * 128) + (t % 4) * 32;
        wgmma_ss_n64(s, descriptor(k_tile + a, 16, 1024), descriptor(q_tile + b, 16, 1024), t > 0);
        wgmma_ss_n64(dp, descriptor(v_tile + a, 16, 1024), descriptor(do_tile + b, 16, 1024), t > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(s);
    fence_accumulators(dp);
}

// Turns Sᵀ into Pᵀ and dPᵀ into dSᵀ in place, for the queries `q0 ..` of the tile whose lse and D
// are at `stats` (`[lse BR][D BR]`). `key` is this thread's first key (the second is +8).
__device__ __forceinline__ void probabilities_and_grads(float (&s)[S_REGS], float (&dp)[S_REGS], const float* stats, int q0, int key,
                                                        bool masked, const BackwardInfo& p) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        const int col = (i / 4) * 8 + (lane % 4) * 2 + (i % 2), query = q0 + col, k = key + ((i / 2) % 2) * 8;
        // A query past q_len was staged as zeros; an infinite lse gives it probability 0.
        const float lse2 = query < (int)p.q_len ? stats[col] * LOG2_E : POS_INF;
        float prob = fast_exp2(fmaf(s[i], p.scale_log2, -lse2));
        if (masked) {
            bool hidden = k >= (int)p.kv_len;
#if KILN_CAUSAL
            hidden |= k > query + (int)p.kv_len - (int)p.q_len;
#endif
            if (hidden) prob = 0.f;
        }
        dp[i] = prob * (dp[i] - stats[BR + col]);
        s[i] = prob;
    }
}

// Writes this thread's packed dSᵀ pairs into the `[key][query]` swizzled tile at `ds` (generic
// pointer), keys `key_row` and `key_row + 8` of the cube's 128.
__device__ __forceinline__ void store_grads(unsigned char* ds, const u32 (&dsr)[S_REGS / 2], int key_row) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int j = 0; j < S_REGS / 2; ++j) {
        const int row = key_row + (j % 2) * 8, chunk = j / 2;
        *reinterpret_cast<u32*>(ds + row * 128 + ((chunk ^ (row % 8)) << 4) + (lane % 4) * 4) = dsr[j];
    }
}

// dV += Pᵀ·dO, dK += dSᵀ·Q (A from registers, B MN-major) and dQ_w = dS·K[:, w·DQ_N ..] (both
// MN-major), issued together and awaited.
__device__ __forceinline__ void gradient_products(float (&dv)[KV_REGS], float (&dk)[KV_REGS], float (&dq)[DQ_REGS], const u32 (&pr)[S_REGS / 2],
                                                  const u32 (&dsr)[S_REGS / 2], u32 q_tile, u32 do_tile, u32 ds_tile, u32 k_tile) {
    wgmma_fence();
    #pragma unroll
    for (int t = 0; t < BR / 16; ++t) {
        WGMMA_KV(dv, pr[4 * t], pr[4 * t + 1], pr[4 * t + 2], pr[4 * t + 3], descriptor(do_tile + t * 16 * 128, BR * 128, 1024));
        WGMMA_KV(dk, dsr[4 * t], dsr[4 * t + 1], dsr[4 * t + 2], dsr[4 * t + 3], descriptor(q_tile + t * 16 * 128, BR * 128, 1024));
    }
    // Warpgroup w's dQ columns start DQ_N elements into the head dim: a whole 64-wide atom for
    // d = 128, half of the one atom for d = 64.
    const u32 columns = (threadIdx.x / 128) * DQ_N;
    const u32 b_base = k_tile + (columns / 64) * (BC * 128) + (columns % 64) * 2;
    #pragma unroll
    for (int t = 0; t < BC / 16; ++t) {
        WGMMA_DQ(dq, descriptor(ds_tile + t * 16 * 128, BC * 128, 1024), descriptor(b_base + t * 16 * 128, BC * 128, 1024), t > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    keep_operands(pr);
    keep_operands(dsr);
    fence_accumulators(dv);
    fence_accumulators(dk);
    fence_accumulators(dq);
}

// Stores `scale ·` a warpgroup's 64 × d accumulator rows `row0`, `row0 + 8` (when below `rows`)
// into the `[rows, KILN_D]` matrix at `out`, rows `stride` elements apart.
__device__ __forceinline__ void store_rows(u16* out, u32 stride, const float (&acc)[KV_REGS], int row0, int rows, float scale) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int x = 0; x < 2; ++x) {
        const int row = row0 + 8 * x;
        if (row >= rows) continue;
        u32* dst = reinterpret_cast<u32*>(out + (u64)row * stride);
        #pragma unroll
        for (int i = 0; i < KV_REGS / 4; ++i) dst[i * 4 + lane % 4] = pack(acc[4 * i + 2 * x] * scale, acc[4 * i + 2 * x + 1] * scale);
    }
}

// q `[batch, q_heads, q_len, d]`, d_out likewise, k/v `[batch, kv_heads, kv_len, d]` (rows
// 16-byte aligned, any strides); lse and delta dense f32 `[batch, q_heads, q_len]` (lse natural
// log, from the forward; delta = Σ dO·O); dq dense f32 `[batch, q_heads, q_len, d]`, zeroed
// (added into); dk, dv `[batch, kv_heads, kv_len, d]` in the input dtype at `p.kv_grads`' strides.
// Grid (key blocks of 128, kv_heads, batch), 256 threads, KILN_SHARED_BYTES of shared memory.
__device__ __forceinline__ void attention_backward(const u16* q_all, const u16* k_all, const u16* v_all, const u16* do_all, const float* lse_all,
                                                   const float* delta_all, float* dq_all, u16* dk_all, u16* dv_all, const BackwardInfo& p) {
    extern __shared__ unsigned char shared_raw[];
    const u32 base = (shared_address(shared_raw) + 1023) & ~1023u;
    unsigned char* shared = shared_raw + (base - shared_address(shared_raw));
    const u32 k_tile = base, v_tile = base + TILE_KV_BYTES;
    auto q_tile = [&](int slot) { return base + 2 * TILE_KV_BYTES + slot * 2 * TILE_Q_BYTES; };
    auto do_tile = [&](int slot) { return q_tile(slot) + TILE_Q_BYTES; };
    const u32 ds_offset = 2 * TILE_KV_BYTES + 4 * TILE_Q_BYTES, stats_offset = ds_offset + TILE_DS_BYTES;

    // Key block x = 0 sees the most queries under the causal mask: it starts first.
    const int key0 = blockIdx.x * BC;
    const u32 kv_head = blockIdx.y, batch = blockIdx.z;
    stage<BC, THREADS>(k_tile, row_at(k_all, p.k, batch, kv_head, key0), p.k.row, (int)p.kv_len - key0);
    stage<BC, THREADS>(v_tile, row_at(v_all, p.v, batch, kv_head, key0), p.v.row, (int)p.kv_len - key0);

    const TileRange range = tile_range(key0, p);
    const int steps = range.count * (int)p.group;
    // Step `n` is query tile `first + n % count` of query head `kv_head · group + n / count`.
    auto head_of = [&](int n) { return kv_head * p.group + n / range.count; };
    auto tile_of = [&](int n) { return range.first + n % range.count; };
    // (`slot`, not `stage`: a parameter named `stage` would turn `stage<BR, THREADS>(..)` into comparisons.)
    auto load = [&](int n, int slot) {
        const u32 head = head_of(n);
        const int q0 = tile_of(n) * BR, valid = (int)p.q_len - q0;
        stage<BR, THREADS>(q_tile(slot), row_at(q_all, p.q, batch, head, q0), p.q.row, valid);
        stage<BR, THREADS>(do_tile(slot), row_at(do_all, p.d_out, batch, head, q0), p.d_out.row, valid);
        if (threadIdx.x < 2 * BR) {
            const int row = threadIdx.x % BR;
            const float* src = (threadIdx.x < BR ? lse_all : delta_all) + ((u64)batch * p.q_heads + head) * p.q_len + q0;
            const bool ok = row < valid;
            copy4(base + stats_offset + slot * STATS_BYTES + threadIdx.x * 4, src + (ok ? row : 0), ok ? 4 : 0);
        }
    };
    if (steps > 0) load(0, 0);
    copy_commit();

    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, wg = threadIdx.x / 128;
    const int key_row = wg * 64 + warp * 16 + lane / 4;  // this thread's first key in the block; the second is +8

    float dk[KV_REGS], dv[KV_REGS];
    #pragma unroll
    for (int i = 0; i < KV_REGS; ++i) dk[i] = dv[i] = 0.f;
    float s[S_REGS], dp[S_REGS], dq[DQ_REGS];
    u32 pr[S_REGS / 2], dsr[S_REGS / 2];

    for (int n = 0; n < steps; ++n) {
        const int stage_index = n % 2, tile = tile_of(n), q0 = tile * BR;
        // Step n's tiles have landed for every thread, and both warpgroups are done with step
        // n − 1 (its stage takes step n + 1, and its dSᵀ is overwritten below).
        copy_wait<0>();
        async_proxy_fence();
        __syncthreads();
        if (n + 1 < steps) {
            load(n + 1, stage_index ^ 1);
            copy_commit();
        }
        scores_and_grads(s, dp, k_tile, v_tile, q_tile(stage_index), do_tile(stage_index));
        const float* stats = reinterpret_cast<const float*>(shared + stats_offset + stage_index * STATS_BYTES);
        probabilities_and_grads(s, dp, stats, q0, key0 + key_row, tile < range.masked_end, p);
        #pragma unroll
        for (int j = 0; j < S_REGS / 2; ++j) {
            pr[j] = pack(s[2 * j], s[2 * j + 1]);
            dsr[j] = pack(dp[2 * j], dp[2 * j + 1]);
        }
        store_grads(shared + ds_offset, dsr, key_row);
        // dS·K reads both warpgroups' rows of dSᵀ.
        async_proxy_fence();
        __syncthreads();
        gradient_products(dv, dk, dq, pr, dsr, q_tile(stage_index), do_tile(stage_index), base + ds_offset, k_tile);

        const u64 head_rows = ((u64)batch * p.q_heads + head_of(n)) * p.q_len;
        #pragma unroll
        for (int x = 0; x < 2; ++x) {
            const int query = q0 + warp * 16 + lane / 4 + 8 * x;
            if (query >= (int)p.q_len) continue;
            float* row = dq_all + (head_rows + query) * KILN_D + wg * DQ_N + (lane % 4) * 2;
            #pragma unroll
            for (int i = 0; i < DQ_REGS / 4; ++i) add2(row + i * 8, dq[4 * i + 2 * x] * p.scale, dq[4 * i + 2 * x + 1] * p.scale);
        }
    }

    const RowStrides g = p.kv_grads;
    const u64 first = (u64)batch * g.batch + (u64)kv_head * g.head + (u64)key0 * g.row;
    const int rows = (int)p.kv_len - key0;
    store_rows(dk_all + first, g.row, dk, key_row, rows, p.scale);
    store_rows(dv_all + first, g.row, dv, key_row, rows, 1.f);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) kiln_attention_backward(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ d_out,
    const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq, u16* __restrict__ dk, u16* __restrict__ dv,
    const __grid_constant__ BackwardInfo info) {
    attention_backward(q, k, v, d_out, lse, delta, dq, dk, dv, info);
}
