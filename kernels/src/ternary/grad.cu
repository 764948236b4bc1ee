// The input gradient of a packed ternary weight on Hopper's warpgroup MMA:
// `dx[m, k] = Σ_n dy[m, n] · w̃[n, k]`, with `w̃ = (c_w − 1) · v[n]` and `v[n] = 1 / s_w[n / group]`
// rounded to the gradient's element type: the weight `ternary_dequantize` writes, which the
// cuBLASLt path multiplies after writing it out, here made from the packed words in shared memory
// so that no float copy of the weight crosses device memory. f16 and bf16 gradients, f32 sums.
//
// As an MMA it is `dxᵀ = w̃ᵀ · dyᵀ`: a cube takes COLS = 128 weight columns (two warpgroups of
// M = 64) by TOKS = 256 or 128 gradient rows (N), the reduction over the weight's rows in blocks of
// BN = 64. An expanded block is stored as the packing orders it, `[n][k]` with k contiguous, which
// is wgmma's M-major A operand, so each packed word expands along its own row: its 2-bit codes
// pick one of `{−v, 0, +v}` by byte permutes (`prmt`), one for two elements. dy's block is
// `[token][n]`, the K-major B operand, which the tensor memory accelerator copies in one
// instruction a block (`dy_map`: a 2-D tensor map of dy with TOKS × 64 boxes, 128-byte swizzle,
// zeros past `m` and `n`) onto the stage's mbarrier.
//
// A ring of STAGES stages is filled STAGES − 2 blocks ahead. Each warpgroup expands block nb + 1
// while block nb's MMAs run, into the third of its VALS value tiles (the other two feed the MMAs
// in flight), and only then waits for block nb − 1's MMAs. The per-block work is kept lean (dy's
// 2048 16-byte `cp.async` copies a block became one tensor copy: 578 → 654 TF/s at 4096 × 11008
// → 4096; descriptors once a block); what bounds the loop at ~65% of the bf16 peak is not
// settled: the MMAs alone with the same barriers ran ~920 TF/s, and neither a third warpgroup
// sharing the copies and expansion nor warpgroups decoupled by mbarriers helped (RESULTS,
// thirty-fourth session). Cubes walk the weight's column tiles fastest, so the cubes in flight
// share a few gradient tiles in L2, and the packed weight (2 bits a weight) stays there too.
//
// Defines: KILN_OUT_KIND (1 f16, 2 bf16; dy and dx share it), KILN_WGMMA_TYPE ("f16", "bf16") and
// KILN_TOKS (256, or 128 where 256-row cubes would leave most SMs idle).
// kiln places `hopper/common.cuh`, `hopper/wgmma.cuh` and `cuda_out.cuh` before this source.

#define COLS 128
#define TOKS KILN_TOKS
#define ACC (TOKS / 2)  // f32 accumulators a thread: its warpgroup's 64 columns by TOKS rows
#if TOKS == 256
#define WGMMA_MA wgmma_ss_ma_n256
#else
#define WGMMA_MA wgmma_ss_ma_n128
#endif
#define BN 64
#define STAGES 4
#define VALS 3
#define THREADS 256
#define DY_TILE (TOKS * BN * 2)
#define W_TILE (BN * COLS / 4)
#define STAGE_BYTES (DY_TILE + W_TILE)
// A warpgroup's 64 columns of one expanded block (the MMA's A operand).
#define VAL_TILE (BN * 64 * 2)
#define VALS_BYTES (VALS * (THREADS / 128) * VAL_TILE)
#define SCALE_TILE (BN * 4)
#define OUT_PITCH (COLS + 16 / (int)sizeof(out_t))
// Bytes of dynamic shared memory the launch requests: the stages, the value tiles, each stage's
// row scales (apart, so that the swizzled tiles stay 1024-byte aligned), the stages' mbarriers,
// and 1 KB to align the tiles.
#define KILN_SHARED_BYTES (STAGES * STAGE_BYTES + VALS_BYTES + STAGES * SCALE_TILE + STAGES * 8 + 1024)

// A CUDA tensor map (`CUtensorMap`), opaque to the kernel; CubeCL encodes it at launch.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

struct GradParams {
    u32 m;          // gradient rows
    u32 n;          // weight rows (the reduction), a multiple of 8
    u32 k;          // weight columns (dx's width)
    u32 row_words;  // packed words per weight row (k padded to 64, over 16)
    u32 group;      // weight rows per scale
    u32 magic_lo;   // ⌈2⁶⁴ / group⌉ for groups above 1: row / group = umul64hi(row, magic) for rows below 2³²
    u32 magic_hi;
};

static_assert(sizeof(out_t) == 2, "f16 or bf16 gradients");

// Where block `nb` of the reduction lands: stage `nb % STAGES`, dy's tile first, then the weight's.
__device__ __forceinline__ u32 stage_at(u32 base, int nb) { return base + (nb % STAGES) * STAGE_BYTES; }

// Block `nb`'s weight-row scales, after the stages and the value tiles.
__device__ __forceinline__ u32 scales_at(u32 base, int nb) { return base + STAGES * STAGE_BYTES + VALS_BYTES + (nb % STAGES) * SCALE_TILE; }

// The mbarrier on which stage `s`'s dy tile lands, after the scales.
__device__ __forceinline__ u32 landed_at(u32 base, int s) { return base + STAGES * STAGE_BYTES + VALS_BYTES + STAGES * SCALE_TILE + 8 * s; }

__device__ __forceinline__ void copy4(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// What a thread below 2 BN copies each block, computed once: one weight row's packed chunk.
struct Copies {
    const unsigned char* w;  // the chunk's row in block 0
    u32 w_slot;
    bool w_ok;               // the chunk lies in the padded row
};

__device__ __forceinline__ Copies copies_of(const unsigned char* w, const GradParams& p, u32 c0) {
    Copies c;
    const u32 wr = threadIdx.x / 2, half = threadIdx.x % 2, word = c0 / 16 + 4 * half;
    c.w = w + ((u64)wr * p.row_words + word) * 4;
    c.w_slot = DY_TILE + wr * (COLS / 4) + half * 16;
    c.w_ok = word < p.row_words;
    return c;
}

// Stages block `nb`: dy's TOKS rows by BN columns (one tensor copy by thread 2 BN, onto the
// stage's mbarrier), BN weight rows of COLS packed columns (zeros past `n` or the padded row)
// and their scales (`cp.async`).
__device__ __forceinline__ void load_block(u32 base, const TensorMap* dy_map, const Copies& c, const float* w_scales, const GradParams& p, u32 tok0, int nb) {
    const u32 stage = stage_at(base, nb), n0 = nb * BN;
    if (threadIdx.x == BN * 2) {
        const u32 landed = landed_at(base, nb % STAGES);
        barrier_expect(landed, DY_TILE);
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(stage),
                     "l"(dy_map), "r"(n0), "r"(tok0), "r"(landed) : "memory");
    }
    if (threadIdx.x < BN * 2) {
        const bool ok = n0 + threadIdx.x / 2 < p.n && c.w_ok;
        copy16(stage + c.w_slot, c.w + (u64)n0 * p.row_words * 4, ok ? 16 : 0);
    } else if (threadIdx.x < BN * 3) {  // (thread 2 BN issues the tensor copy too)
        const u32 row = n0 + threadIdx.x - BN * 2, group = p.group == 1 ? row : (u32)__umul64hi(row, ((u64)p.magic_hi << 32) | p.magic_lo);
        copy4(scales_at(base, nb) + (threadIdx.x - BN * 2) * 4, w_scales + group, row < p.n ? 4 : 0);
    }
}

// The expanded magnitude of a weight row of scale `s`, `1 / s` rounded to the element type, as bits.
__device__ __forceinline__ u32 magnitude(float s) {
    float v;
    asm("rcp.rn.f32 %0, %1;" : "=f"(v) : "f"(s));  // 1 / s, rounded as the division rounds it
    return kiln_out(v);
}

__device__ __forceinline__ u32 permute(u32 lo, u32 hi, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(selector));
    return r;
}

// The magnitude of this thread's row in the last block it expanded, kept while the scale repeats
// (one scale for the whole weight is the usual case), since the reciprocal has a slow path.
struct Magnitude {
    float scale = 0.f;  // no scale is 0
    u32 bits = 0;
};

// Expands this warpgroup's 64 columns of staged block `nb` into the value tile `vals` (`[BN][64]`
// elements, 128-byte swizzle): thread `i` of the warpgroup takes two words of row `i / 2`, each 16
// elements, two 16-byte stores. Elements `4g … 4g+3` of a word are the bytes of
// `(word >> 2g) & 0x03030303` (the packing in `mod.rs`), and `c · 0x22 + 0x10` of a code `c` is a
// `prmt` selector for bytes `2c, 2c+1` of `{−v, 0, +v, 0}`: the element `(c − 1) · v`. Rows past
// `n` expand to zeros.
__device__ __forceinline__ void expand(u32 vals, u32 base, int nb, int wg, const GradParams& p, Magnitude& mag) {
    const int i = threadIdx.x % 128;
    const u32 r = i / 2, h = i % 2;
    float s;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(s) : "r"(scales_at(base, nb) + r * 4));
    if (s != mag.scale) {
        mag.scale = s;
        mag.bits = magnitude(s);
    }
    const u32 v = nb * BN + r < p.n ? mag.bits : 0u, lo = v ^ 0x8000u, hi = v;
    u32 word[2];
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(word[0]), "=r"(word[1]) : "r"(stage_at(base, nb) + DY_TILE + r * (COLS / 4) + wg * 16 + h * 8));
    #pragma unroll
    for (int q = 0; q < 2; ++q) {
        u32 e[8];
        #pragma unroll
        for (int g = 0; g < 4; ++g) {
            const u32 selector = ((word[q] >> (2 * g)) & 0x03030303u) * 0x22u + 0x10101010u;
            e[2 * g] = permute(lo, hi, selector);
            e[2 * g + 1] = permute(lo, hi, selector >> 16);
        }
        // Word 2h + q of the half holds columns 16 (2h + q) …: chunks 2 (2h + q) and the next.
        const u32 c = 2 * (2 * h + q);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(vals + r * 128 + ((c ^ (r % 8)) << 4)), "r"(e[0]), "r"(e[1]), "r"(e[2]), "r"(e[3]));
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(vals + r * 128 + (((c + 1) ^ (r % 8)) << 4)), "r"(e[4]), "r"(e[5]), "r"(e[6]), "r"(e[7]));
    }
}

// One block of the main loop: wait for block nb + 1's copies, refill the stage freed two blocks
// ago, issue this block's four k16 MMAs, expand block nb + 1 into the value tile no MMA in flight
// reads, then retire block nb − 1's MMAs (freeing its tile for the next step's expansion).
__device__ __forceinline__ void step(float (&acc)[ACC], u32 vals, u32 base, int nb, int blocks, int wg, const TensorMap* dy_map, const Copies& c,
                                     const float* w_scales, const GradParams& p, u32 tok0, Magnitude& mag) {
    copy_wait<STAGES - 4>();
    async_proxy_fence();  // this thread's expanded values and copies, before the barrier shows them to wgmma
    __syncthreads();
    barrier_wait(landed_at(base, nb % STAGES), (nb / STAGES) & 1);
    if (nb + STAGES - 2 < blocks) load_block(base, dy_map, c, w_scales, p, tok0, nb + STAGES - 2);
    copy_commit();
    // Descriptors of the block's first k16 step; a step advances A by 16 rows of 128 bytes and B by
    // 32 bytes (the descriptors count 16-byte units).
    const u64 a = descriptor(vals + (nb % VALS) * VAL_TILE, BN * 128, 1024), b = descriptor(stage_at(base, nb), 16, 1024);
    wgmma_fence();
    #pragma unroll
    for (int s = 0; s < BN / 16; ++s) WGMMA_MA(acc, a + s * (16 * 128 / 16), b + s * (32 / 16), 1);
    wgmma_commit();
    if (nb + 1 < blocks) expand(vals + ((nb + 1) % VALS) * VAL_TILE, base, nb + 1, wg, p, mag);
    wgmma_wait<1>();
}

// dy_map: the tensor map of dy (dense `[m, n]`, passed as `dy` too, unread); w `[n, row_words]`
// packed words; w_scales one f32 per `group` rows; dx dense `[m, k]`. One cube per (gradient tile,
// column tile), column tiles fastest; THREADS threads, KILN_SHARED_BYTES of shared memory.
extern "C" __global__ void __launch_bounds__(THREADS, 1) kiln_ternary_input_grad(
    const __grid_constant__ TensorMap dy_map, const out_t* __restrict__ dy, const unsigned char* __restrict__ w, const float* __restrict__ w_scales,
    out_t* __restrict__ dx, const __grid_constant__ GradParams p) {
    extern __shared__ unsigned char shared_raw[];
    const u32 base = (shared_address(shared_raw) + 1023) & ~1023u;
    const u32 col_tiles = (p.k + COLS - 1) / COLS, tok0 = (blockIdx.x / col_tiles) * TOKS, c0 = (blockIdx.x % col_tiles) * COLS;
    const int blocks = (p.n + BN - 1) / BN;
    const Copies c = copies_of(w, p, c0);
    if (threadIdx.x == BN * 2) {
        for (int s = 0; s < STAGES; ++s) barrier_init(landed_at(base, s));
        barrier_init_fence();
    }
    __syncthreads();
    #pragma unroll
    for (int nb = 0; nb < STAGES - 2; ++nb) {
        if (nb < blocks) load_block(base, &dy_map, c, w_scales, p, tok0, nb);
        copy_commit();
    }

    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, wg = threadIdx.x / 128;
    const u32 vals = base + STAGES * STAGE_BYTES + wg * VALS * VAL_TILE;
    Magnitude mag;
    copy_wait<STAGES - 3>();
    __syncthreads();
    expand(vals, base, 0, wg, p, mag);
    float acc[ACC];
    #pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
    for (int nb = 0; nb < blocks; ++nb) step(acc, vals, base, nb, blocks, wg, &dy_map, c, w_scales, p, tok0, mag);
    wgmma_wait<0>();
    fence_accumulators(acc);
    copy_wait<0>();
    __syncthreads();  // every warpgroup is done reading the stages: the output tile reuses them

    // Round into the output tile `[TOKS][OUT_PITCH]` in shared memory: acc[4j + 2h + e] is
    // gradient row 8j + 2t + e, weight column `col + 8h`. (The `+ 0.f` keeps ptxas from
    // serializing the wgmmas: converting an accumulator register straight to 16 bits made it
    // report C7514 and wait after every MMA.)
    out_t* tile = reinterpret_cast<out_t*>(shared_raw + (base - shared_address(shared_raw)));
    stage_pairs_transposed<TOKS / 8>(base, OUT_PITCH, wg * 64 + warp * 16, lane, [&](int j, int h) { return kiln_out2(acc[4 * j + 2 * h] + 0.f, acc[4 * j + 2 * h + 1] + 0.f); });
    __syncthreads();
    store_tile<TOKS, COLS, THREADS>(dx, tile, OUT_PITCH, p.m, p.k, tok0, c0);
}
