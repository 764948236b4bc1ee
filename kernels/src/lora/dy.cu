// LoRA's two backward products that read the output gradient, in one pass over it:
// `dh = dy · B` (`[tokens, r]`) and `dB = dyᵀ · h` (`[out, r]`), the scales left to the sum
// (`kiln_lora_dy_sum`). Each product alone is a skinny GEMM that reads all of `dy`; cuBLASLt
// took 10–13 µs for each at 4096 × 4096, rank 16, on the H200, where reading `dy` once takes ~8
// (`benches/RESULTS.md`, forty-eighth session).
//
// A cube owns KILN_TOKENS tokens and a range of output features (its split), which it walks in
// chunks of KILN_CHUNK features through a ring of KILN_STAGES slots filled by `cp.async`. A slot
// holds the chunk of `dy` (rows = tokens, padded to 144 bytes so that `ldmatrix`'s eight rows hit
// distinct banks) and the chunk's rows of `B`; the cube's rows of `h` are loaded once. The same
// `dy` tile is the A operand of both `mma.sync.m16n8k16` products: read by `ldmatrix` for `dh`
// (tokens × features) and by `ldmatrix.trans` for `dB` (features × tokens).
//   - `dh`: warp w accumulates its 32 tokens over every chunk of the split; at the end it writes
//     them to its split's slice of `part_dh` (f32 `[splits, tokens, r]`).
//   - `dB`: a chunk's 64 features are four tiles of 16; warp w takes tile w % 4 over half of the
//     cube's tokens (w / 4). The upper warps hand their sums to the lower ones through shared
//     memory, which write the chunk's rows to the cube's slice of `part_db` (f32
//     `[token tiles, out, r]`). The B fragments of `h` a warp needs are the same for every chunk:
//     up to rank 16 they stay in registers (1.5 µs of 13.2 at 4096², H200), above it they are
//     reloaded from the cube's copy each chunk. Chunks of 128 features (no hand-over, two slots),
//     deeper rings and other splits measured no faster (forty-ninth session).
// Tokens past `tokens` and features past `out` are zero-filled copies and are never stored.
//
// `kiln_lora_dy_sum` adds the slices, scales them (`dh`'s and `dB`'s own scale) and rounds to the
// activations' element.
//
// Layouts: `dy` `[tokens, out]`, `B` `[out, r]`, `h` `[tokens, r]`, dense row-major, 16-byte
// aligned, `out` and `r` multiples of 8. Defines: KILN_KIND (1 f16, 2 bf16; KILN_OUT_KIND the
// same), KILN_NJ (r / 8, 1 … 8), KILN_STAGES (≥ 2), optionally KILN_H_HELD (0: reload `h`'s
// fragments every chunk, for measurements). kiln places `hopper/common.cuh`, `cuda_out.cuh` and
// `lora/mma.cuh` before this source.

#define KILN_TOKENS 256
#define KILN_CHUNK 64
#define KILN_THREADS 256
// The k steps of a warp's dB product: half the cube's tokens, 16 a step.
#define KILN_DB_STEPS (KILN_TOKENS / 2 / 16)
// Whether a warp holds its B fragments of h in registers (16 · r / 8 … words a lane) or reloads them each chunk.
#ifndef KILN_H_HELD
#define KILN_H_HELD (KILN_DB_STEPS * KILN_NJ <= 16)
#endif
#define KILN_R (KILN_NJ * 8)
#define KILN_DY_PITCH (KILN_CHUNK + 8)
#define KILN_R_PITCH (KILN_R + 8)
#define KILN_DY_BYTES (KILN_TOKENS * KILN_DY_PITCH * 2)
#define KILN_B_BYTES (KILN_CHUNK * KILN_R_PITCH * 2)
#define KILN_STAGE_BYTES (KILN_DY_BYTES + KILN_B_BYTES)
#define KILN_H_BYTES (KILN_TOKENS * KILN_R_PITCH * 2)

__device__ __forceinline__ void ldsm4(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void ldsm4_trans(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void ldsm2_trans(u32& r0, u32& r1, u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(address));
}

// B fragments of N n-tiles for the 16 rows `k0 …` of a `[k][n]` tile (rows PITCH elements
// apart, at shared address `tile`): `ldmatrix.trans` gives lane (g, t) rows 2t, 2t + 1 (+ 8) of
// column g. Matrix q of an x4 is rows k0 + 8 (q % 2), n-tile j + q / 2.
template <int N, int PITCH>
__device__ __forceinline__ void b_fragments(u32 (&b)[N][2], u32 tile, u32 k0, u32 lane) {
    const u32 q = lane / 8, row = k0 + lane % 8 + 8 * (q % 2);
#pragma unroll
    for (int j = 0; j + 1 < N; j += 2) {
        u32 r[4];
        ldsm4_trans(r, tile + (row * PITCH + 8 * (j + q / 2)) * 2);
        b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
    }
    if (N % 2) ldsm2_trans(b[N - 1][0], b[N - 1][1], tile + (row * PITCH + 8 * (N - 1)) * 2);
}

struct Params {
    u32 tokens;     // rows of dy and h
    u32 out;        // columns of dy, rows of B
    u32 chunks;     // ⌈out / KILN_CHUNK⌉
    u32 per_split;  // chunks a split
};

extern "C" __global__ void __launch_bounds__(KILN_THREADS) kiln_lora_dy(
    const u16* __restrict__ dy, const u16* __restrict__ b, const u16* __restrict__ h,
    float* __restrict__ part_dh, float* __restrict__ part_db, const __grid_constant__ Params p) {
    extern __shared__ uint4 kiln_lora_shared[];
    const u32 tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    const u32 ring = shared_address(kiln_lora_shared);
    const u32 h_tile = ring + KILN_STAGES * KILN_STAGE_BYTES;
    const u32 scratch = h_tile + KILN_H_BYTES;
    const u32 split = blockIdx.x, tile = blockIdx.y, tok0 = tile * KILN_TOKENS;
    const u32 c_begin = split * p.per_split, steps = min(c_begin + p.per_split, p.chunks) - c_begin;

    // Chunk i of the split into its slot: pieces of 16 bytes, KILN_CHUNK / 8 a token row of dy and
    // r / 8 a row of B.
    auto load = [&](u32 i) {
        const u32 slot = ring + (i % KILN_STAGES) * KILN_STAGE_BYTES, o0 = (c_begin + i) * KILN_CHUNK;
#pragma unroll
        for (int q = 0; q < KILN_TOKENS * (KILN_CHUNK / 8) / KILN_THREADS; ++q) {
            const u32 piece = tid + q * KILN_THREADS, row = piece / (KILN_CHUNK / 8), col = piece % (KILN_CHUNK / 8) * 8;
            const bool in = tok0 + row < p.tokens && o0 + col < p.out;
            copy16(slot + (row * KILN_DY_PITCH + col) * 2, in ? dy + (size_t)(tok0 + row) * p.out + o0 + col : dy, in ? 16 : 0);
        }
        for (u32 piece = tid; piece < KILN_CHUNK * KILN_NJ; piece += KILN_THREADS) {
            const u32 row = piece / KILN_NJ, col = piece % KILN_NJ * 8;
            const bool in = o0 + row < p.out;
            copy16(slot + KILN_DY_BYTES + (row * KILN_R_PITCH + col) * 2, in ? b + (size_t)(o0 + row) * KILN_R + col : b, in ? 16 : 0);
        }
    };
    for (u32 piece = tid; piece < KILN_TOKENS * KILN_NJ; piece += KILN_THREADS) {
        const u32 row = piece / KILN_NJ, col = piece % KILN_NJ * 8;
        const bool in = tok0 + row < p.tokens;
        copy16(h_tile + (row * KILN_R_PITCH + col) * 2, in ? h + (size_t)(tok0 + row) * KILN_R + col : h, in ? 16 : 0);
    }
#pragma unroll
    for (u32 s = 0; s + 1 < KILN_STAGES; ++s) {
        if (s < steps) load(s);
        copy_commit();
    }

    float dh[2][KILN_NJ][4] = {};
    const u32 mo = warp % 4 * 16, half = warp / 4 * (KILN_TOKENS / 2);
#if KILN_H_HELD
    // The warp's B fragments of h are the same for every chunk: loaded once, with the first chunk.
    copy_wait<KILN_STAGES - 2>();
    __syncthreads();
    u32 hf[KILN_DB_STEPS][KILN_NJ][2];
#pragma unroll
    for (int ks = 0; ks < KILN_DB_STEPS; ++ks) b_fragments<KILN_NJ, KILN_R_PITCH>(hf[ks], h_tile, half + 16 * ks, lane);
#endif
    for (u32 i = 0; i < steps; ++i) {
        copy_wait<KILN_STAGES - 2>();
        __syncthreads();
        if (i + KILN_STAGES - 1 < steps) load(i + KILN_STAGES - 1);
        copy_commit();
        const u32 slot = ring + (i % KILN_STAGES) * KILN_STAGE_BYTES;

        // dh[warp's 32 tokens] += dy[those tokens, chunk] · B[chunk]
#pragma unroll
        for (u32 k0 = 0; k0 < KILN_CHUNK; k0 += 16) {
            u32 bf[KILN_NJ][2];
            b_fragments<KILN_NJ, KILN_R_PITCH>(bf, slot + KILN_DY_BYTES, k0, lane);
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                u32 a[4];
                ldsm4(a, slot + ((warp * 32 + m * 16 + lane % 16) * KILN_DY_PITCH + k0 + lane / 16 * 8) * 2);
#pragma unroll
                for (int j = 0; j < KILN_NJ; ++j) lora_mma(dh[m][j], a, bf[j][0], bf[j][1]);
            }
        }

        // dB[chunk's features mo …] = dy[the warp's tokens, those features]ᵀ · h[the warp's tokens]
        float db[KILN_NJ][4] = {};
#pragma unroll
        for (int ks = 0; ks < KILN_DB_STEPS; ++ks) {
#if KILN_H_HELD
            const u32 (&bf)[KILN_NJ][2] = hf[ks];
#else
            u32 bf[KILN_NJ][2];
            b_fragments<KILN_NJ, KILN_R_PITCH>(bf, h_tile, half + 16 * ks, lane);
#endif
            u32 a[4];
            const u32 q = lane / 8;
            ldsm4_trans(a, slot + ((half + 16 * ks + lane % 8 + 8 * (q / 2)) * KILN_DY_PITCH + mo + 8 * (q % 2)) * 2);
#pragma unroll
            for (int j = 0; j < KILN_NJ; ++j) lora_mma(db[j], a, bf[j][0], bf[j][1]);
        }
        // The upper warps' halves to the lower ones, which store the chunk's rows.
        float* const spare = reinterpret_cast<float*>(kiln_lora_shared) + (scratch - ring) / 4;
        if (warp >= 4) {
#pragma unroll
            for (int j = 0; j < KILN_NJ; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) spare[(((warp - 4) * KILN_NJ + j) * 4 + c) * 32 + lane] = db[j][c];
        }
        __syncthreads();
        if (warp < 4) {
            const u32 o = (c_begin + i) * KILN_CHUNK + mo + g;
#pragma unroll
            for (int j = 0; j < KILN_NJ; ++j) {
#pragma unroll
                for (int c = 0; c < 4; ++c) db[j][c] += spare[((warp * KILN_NJ + j) * 4 + c) * 32 + lane];
                float* row = part_db + ((size_t)tile * p.out + o) * KILN_R + 8 * j + 2 * t;
                if (o < p.out) *reinterpret_cast<float2*>(row) = make_float2(db[j][0], db[j][1]);
                if (o + 8 < p.out) *reinterpret_cast<float2*>(row + 8 * KILN_R) = make_float2(db[j][2], db[j][3]);
            }
        }
    }

#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const u32 tok = tok0 + warp * 32 + m * 16 + g;
#pragma unroll
        for (int j = 0; j < KILN_NJ; ++j) {
            float* row = part_dh + ((size_t)split * p.tokens + tok) * KILN_R + 8 * j + 2 * t;
            if (tok < p.tokens) *reinterpret_cast<float2*>(row) = make_float2(dh[m][j][0], dh[m][j][1]);
            if (tok + 8 < p.tokens) *reinterpret_cast<float2*>(row + 8 * KILN_R) = make_float2(dh[m][j][2], dh[m][j][3]);
        }
    }
}

struct SumParams {
    u32 dh_len;  // tokens · r
    u32 db_len;  // out · r
    u32 splits;  // slices of part_dh
    u32 tiles;   // slices of part_db
    float scale_dh;
    float scale_db;
};

// dh = s_dh · Σ part_dh over splits, dB = s_db · Σ part_db over token tiles: four elements a thread.
extern "C" __global__ void __launch_bounds__(256) kiln_lora_dy_sum(
    const float4* __restrict__ part_dh, const float4* __restrict__ part_db, uint2* __restrict__ dh, uint2* __restrict__ db,
    const __grid_constant__ SumParams p) {
    const u32 i = blockIdx.x * 256 + threadIdx.x, dh4 = p.dh_len / 4, db4 = p.db_len / 4;
    const bool first = i < dh4;
    const u32 at = first ? i : i - dh4, len = first ? dh4 : db4, slices = first ? p.splits : p.tiles;
    if (!first && at >= db4) return;
    const float4* src = (first ? part_dh : part_db) + at;
    float4 sum = src[0];
    for (u32 s = 1; s < slices; ++s) {
        const float4 v = src[(size_t)s * len];
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    const float s = first ? p.scale_dh : p.scale_db;
    (first ? dh : db)[at] = make_uint2(kiln_out2(s * sum.x, s * sum.y), kiln_out2(s * sum.z, s * sum.w));
}
