// Flash attention forward on Hopper's warpgroup MMA (wgmma), f16/bf16 in, f32 accumulate.
//
// CubeCL 0.10 reaches the tensor cores only through `mma.sync`; this kernel is CUDA C++ that kiln
// compiles through CubeCL's own NVRTC path (sm_90a) and launches on CubeCL's stream. It computes
// what `mma/forward.rs` computes for its common case (no softcap, bias or window; one split):
// `out = softmax(scale · q·kᵀ, masked) · v` and the row log-sum-exp, with the same conventions
// (bottom-right causal alignment, a row with no visible key gets 0 and `EMPTY_LSE`).
//
// Compile-time parameters, defined before this source:
//   KILN_D         head dim, 64 or 128
//   KILN_BC        keys per tile, 64 or 128
//   KILN_WG        warpgroups per cube; each owns 64 query rows
//   KILN_CAUSAL    0 or 1
//   KILN_WGMMA_TYPE "bf16" or "f16", KILN_F16 0 or 1 (the same choice)
//   KILN_EMPTY_LSE the log-sum-exp of a row that sees no key (`EMPTY_LSE` on the Rust side)
//
// Work of one cube: one (batch, q head) and 64·KILN_WG query rows. Every thread helps stage
// tiles into shared memory with 16-byte `cp.async` (three K/V stages in a ring, one tile ahead); each warpgroup
// then runs `S = Q·Kᵀ` (both operands from shared memory), the online softmax in registers, and
// `O += P·V` with P straight from the S registers (the accumulator layout of one wgmma is the A
// operand layout of the next). Within an iteration the warpgroup issues `S_j = Q·K_jᵀ` and
// `O += P_{j-1}·V_{j-1}` together, then runs the softmax of S_j.
//
// Shared-memory tiles are swizzled as `common.cuh` describes.

// kiln places `hopper/common.cuh`, `hopper/wgmma.cuh` (the generated MMA wrappers) and this
// folder's `common.cuh` before this source.

#define ROWS (64 * KILN_WG)
#define THREADS (128 * KILN_WG)
#define STAGES 3
#define TILE_Q_BYTES (ROWS * KILN_D * 2)
#define TILE_KV_BYTES (KILN_BC * KILN_D * 2)
#define S_REGS (KILN_BC / 2)
#define O_REGS (KILN_D / 2)

// Bytes of dynamic shared memory the launch must request (1 KB more for alignment).
#define KILN_SHARED_BYTES (TILE_Q_BYTES + STAGES * 2 * TILE_KV_BYTES + 1024)

#if KILN_BC == 64
#define WGMMA_S wgmma_ss_n64
#else
#define WGMMA_S wgmma_ss_n128
#endif
#if KILN_D == 64
#define WGMMA_O wgmma_rs_n64
#else
#define WGMMA_O wgmma_rs_n128
#endif

// Scalars of a launch (CubeCL passes them as one struct by value, after the buffers).
struct Info {
    u32 q_heads, group, q_len, kv_len;
    RowStrides q, k, v, out;
    float scale_log2;  // softmax scale · log2(e)
};

// Row-wise state of the two query rows a thread holds (rows r and r + 8 of its warp's 16).
struct Rows {
    float max[2];  // running max of the scaled logits (log2 units), -inf before any visible key
    float sum[2];  // this thread's partial sums of 2^(logit − max)
};

// Masks invisible keys of tile `key0` to -inf: past `kv_len`, or (causal) past the query's diagonal.
__device__ __forceinline__ void mask(float (&s)[S_REGS], int key0, int row0, const Info& p) {
    int lane = threadIdx.x % 32;
    #pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        int key = key0 + (i / 4) * 8 + (lane % 4) * 2 + (i % 2);
        bool hidden = key >= (int)p.kv_len;
#if KILN_CAUSAL
        int row = row0 + ((i / 2) % 2) * 8;
        hidden |= key > row + (int)p.kv_len - (int)p.q_len;
#endif
        if (hidden) s[i] = NEG_INF;
    }
}

// Online softmax of one tile: updates `rows`, turns `s` into probabilities in place, and returns
// the factors that rescale the output accumulated so far.
__device__ __forceinline__ void softmax(float (&s)[S_REGS], Rows& rows, float (&alpha)[2], float scale) {
    #pragma unroll
    for (int x = 0; x < 2; ++x) {
        float m = rows.max[x];
        #pragma unroll
        for (int i = 0; i < S_REGS / 4; ++i) m = fmaxf(m, fmaxf(s[4 * i + 2 * x], s[4 * i + 2 * x + 1]) * scale);
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
        // With no visible key yet the max is -inf; shifting by 0 keeps every exponent -inf.
        float shift = m == NEG_INF ? 0.f : m;
        alpha[x] = fast_exp2(rows.max[x] - shift);
        rows.max[x] = m;
        float sum = 0.f;
        #pragma unroll
        for (int i = 0; i < S_REGS / 4; ++i) {
            float a = fast_exp2(fmaf(s[4 * i + 2 * x], scale, -shift));
            float b = fast_exp2(fmaf(s[4 * i + 2 * x + 1], scale, -shift));
            s[4 * i + 2 * x] = a;
            s[4 * i + 2 * x + 1] = b;
            sum += a + b;
        }
        rows.sum[x] = rows.sum[x] * alpha[x] + sum;
    }
}

// Probabilities as the packed A operand of `O += P·V`.
__device__ __forceinline__ void probabilities(const float (&s)[S_REGS], u32 (&pr)[S_REGS / 2]) {
    #pragma unroll
    for (int i = 0; i < S_REGS / 2; ++i) pr[i] = pack(s[2 * i], s[2 * i + 1]);
}

__device__ __forceinline__ void rescale(float (&o)[O_REGS], const float (&alpha)[2]) {
    #pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] *= alpha[(i / 2) % 2];
}

// S = Q·K_tileᵀ for this warpgroup's 64 rows (issued, not awaited).
__device__ __forceinline__ void issue_scores(float (&s)[S_REGS], u32 q_tile, u32 k_tile) {
    u32 wg = threadIdx.x / 128;
    wgmma_fence();
    #pragma unroll
    for (int t = 0; t < KILN_D / 16; ++t) {
        u64 a = descriptor(q_tile + (t / 4) * (ROWS * 128) + wg * (64 * 128) + (t % 4) * 32, 16, 1024);
        u64 b = descriptor(k_tile + (t / 4) * (KILN_BC * 128) + (t % 4) * 32, 16, 1024);
        WGMMA_S(s, a, b, t > 0);
    }
    wgmma_commit();
}

// O += P·V_tile (issued, not awaited); V is N-major: d contiguous within 64-wide atoms.
__device__ __forceinline__ void issue_output(float (&o)[O_REGS], const u32 (&pr)[S_REGS / 2], u32 v_tile) {
    wgmma_fence();
    #pragma unroll
    for (int t = 0; t < KILN_BC / 16; ++t) {
        WGMMA_O(o, pr[4 * t], pr[4 * t + 1], pr[4 * t + 2], pr[4 * t + 3], descriptor(v_tile + t * 16 * 128, KILN_BC * 128, 1024));
    }
    wgmma_commit();
}

// q `[batch, q_heads, q_len, d]`, k/v `[batch, kv_heads, kv_len, d]` (rows 16-byte aligned, any
// strides); out dense `[batch, q_heads, q_len, d]`, lse dense `[batch, q_heads, q_len]` f32.
// Grid (row blocks, q_heads, batch), 128·KILN_WG threads, KILN_SHARED_BYTES of shared memory.
__device__ __forceinline__ void attention_forward(const u16* q_all, const u16* k_all, const u16* v_all, u16* out_all, float* lse, const Info& p) {
    extern __shared__ unsigned char shared_raw[];
    const u32 base = (shared_address(shared_raw) + 1023) & ~1023u;
    const u32 q_tile = base;
    auto k_tile = [&](int stage) { return base + TILE_Q_BYTES + stage * 2 * TILE_KV_BYTES; };
    auto v_tile = [&](int stage) { return k_tile(stage) + TILE_KV_BYTES; };

    // Longest (causal) row blocks first.
    const int blocks_q = (p.q_len + ROWS - 1) / ROWS;
    const int q0 = (blocks_q - 1 - (int)blockIdx.x) * ROWS;
    const u32 head = blockIdx.y, batch = blockIdx.z, kv_head = head / p.group;
    const u16* q = row_at(q_all, p.q, batch, head, q0);
    const u16* k = row_at(k_all, p.k, batch, kv_head, 0);
    const u16* v = row_at(v_all, p.v, batch, kv_head, 0);

    int kv_end = p.kv_len;
#if KILN_CAUSAL
    kv_end = min(kv_end, max(0, min(q0 + ROWS, (int)p.q_len) + (int)p.kv_len - (int)p.q_len));
#endif
    const int tiles = (kv_end + KILN_BC - 1) / KILN_BC;
    // Tiles from `first_masked` on may hold keys that some row of this cube must not see.
    int first_masked = p.kv_len / KILN_BC;
#if KILN_CAUSAL
    first_masked = min(first_masked, max(0, q0 + (int)p.kv_len - (int)p.q_len + 1) / KILN_BC);
#endif

    auto load = [&](int tile) {
        int key0 = tile * KILN_BC, stage_index = tile % STAGES;
        stage<KILN_BC, THREADS>(k_tile(stage_index), k + (u64)key0 * p.k.row, p.k.row, (int)p.kv_len - key0);
        stage<KILN_BC, THREADS>(v_tile(stage_index), v + (u64)key0 * p.v.row, p.v.row, (int)p.kv_len - key0);
    };
    stage<ROWS, THREADS>(q_tile, q, p.q.row, (int)p.q_len - q0);
    if (tiles > 0) load(0);
    copy_commit();

    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, wg = threadIdx.x / 128;
    const int row0 = q0 + wg * 64 + warp * 16 + lane / 4;  // this thread's first row; the second is +8

    float o[O_REGS];
    #pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    float s[S_REGS];
    u32 pr[S_REGS / 2];
    Rows rows = {{NEG_INF, NEG_INF}, {0.f, 0.f}};
    float alpha[2];

    for (int j = 0; j < tiles; ++j) {
        // Tile j has landed for every thread, and every warpgroup is done with tile j − 2, whose
        // stage takes tile j + 1 (this iteration reads K_j and V_{j−1}).
        copy_wait<0>();
        async_proxy_fence();
        __syncthreads();
        if (j + 1 < tiles) {
            load(j + 1);
            copy_commit();
        }
        issue_scores(s, q_tile, k_tile(j % STAGES));
        if (j > 0) issue_output(o, pr, v_tile((j - 1) % STAGES));
        // Both products complete before the softmax. Waiting for S alone (letting P·V run under
        // the softmax) gave wrong outputs with CUDA 13.0's ptxas: it handed the A registers of the
        // in-flight P·V to the softmax's temporaries. Measured on the H100, the overlap was not
        // faster than this order anyway (the other warpgroup fills the tensor cores meanwhile).
        wgmma_wait<0>();
        fence_accumulators(s);
        fence_accumulators(o);
        if (j >= first_masked) mask(s, j * KILN_BC, row0, p);
        softmax(s, rows, alpha, p.scale_log2);
        rescale(o, alpha);
        probabilities(s, pr);
    }
    if (tiles > 0) {
        issue_output(o, pr, v_tile((tiles - 1) % STAGES));
        wgmma_wait<0>();
        fence_accumulators(o);
    }

    // Finish the rows: full sums over the quad, normalize, store output pairs and the log-sum-exp.
    #pragma unroll
    for (int x = 0; x < 2; ++x) {
        float sum = rows.sum[x];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        int row = row0 + 8 * x;
        if (row >= (int)p.q_len) continue;
        float inv = sum > 0.f ? 1.f / sum : 0.f;
        u64 stat = ((u64)batch * p.q_heads + head) * p.q_len + row;
        u32* out = reinterpret_cast<u32*>(out_all + (u64)batch * p.out.batch + (u64)head * p.out.head + (u64)row * p.out.row);
        #pragma unroll
        for (int i = 0; i < O_REGS / 4; ++i) out[i * 4 + lane % 4] = pack(o[4 * i + 2 * x] * inv, o[4 * i + 2 * x + 1] * inv);
        if (lane % 4 == 0) lse[stat] = sum > 0.f ? rows.max[x] * 0.69314718f + __logf(sum) : KILN_EMPTY_LSE;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) kiln_attention_forward(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ out,
    float* __restrict__ lse, const __grid_constant__ Info info) {
    attention_forward(q, k, v, out, lse, info);
}
