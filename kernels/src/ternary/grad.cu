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
// A cube is three warpgroups. The first makes the operands: one thread issues dy's tensor copies
// (a ring of STAGES stages, two blocks ahead), and each thread copies half of one weight row of a
// block (one MMA warpgroup's 64 columns) and that row's scale (`cp.async`, a ring W_LEAD blocks
// ahead) and expands them into that warpgroup's value tile. The other two (M = 64 columns each)
// only run the MMAs. Step nb: one cube barrier (named barrier 1, reached from each role's own
// loop: a branch on the role inside one loop makes ptxas serialize the wgmmas) publishes block
// nb's values and retires block nb − 2's MMAs; the MMA warpgroups wait for dy's tile, issue the
// block's four k16 MMAs and retire block nb − 1's, while the first warpgroup refills the rings
// and expands block nb + 1 into the third of the VALS value tiles. Against two warpgroups that
// each expanded their own columns between their MMAs (and `__syncthreads` a block) this ran
// 3–6% faster, 651–704 TF/s from 2048 rows (`benches/RESULTS.md`, thirty-seventh session; the
// same structure lifted an NF4 probe's MMA-only ceiling from ~590 to ~700 TF/s). Cubes walk the
// weight's column tiles fastest, so the cubes in flight share a few gradient tiles in L2, and
// the packed weight (2 bits a weight) stays there too.
//
// Split the reduction (KILN_SPLITS = 2 or 3, where a launch has too few tiles to fill the SMs): as
// in the GEMM, the SPLITS cubes of a tile form one thread-block cluster, each runs its share of
// the weight's rows, and the tile's first cube adds the others' f32 sums (in rank order) through
// distributed shared memory (`gather_splits`) before its epilogue.
//
// Defines: KILN_OUT_KIND (1 f16, 2 bf16; dy and dx share it), KILN_WGMMA_TYPE ("f16", "bf16"),
// KILN_TOKS (256 or 128) and KILN_SPLITS (1, 2, 3).
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
#define W_STAGES 8
#define W_LEAD 6
#define VALS 3
#define THREADS 384
#define MAKERS 128
#define MMA_THREADS 256
#define SPLITS KILN_SPLITS
#define DY_TILE (TOKS * BN * 2)
#define W_TILE (BN * COLS / 4)
// Each making thread's copy of its row's scale.
#define SCALE_TILE (MAKERS * 4)
#define W_STAGE_BYTES (W_TILE + SCALE_TILE)
// An MMA warpgroup's 64 columns of one expanded block (its A operand); a slot holds both.
#define VAL_TILE (BN * 64 * 2)
#define VALS_BYTES (VALS * 2 * VAL_TILE)
#define OUT_PITCH (COLS + 16 / (int)sizeof(out_t))
// Bytes of dynamic shared memory the launch requests: dy's stages, the value tiles, the weight's
// ring, the stages' mbarriers, and 1 KB to align the tiles.
#define KILN_SHARED_BYTES (STAGES * DY_TILE + VALS_BYTES + W_STAGES * W_STAGE_BYTES + STAGES * 8 + 1024)

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
static_assert(MAKERS == 2 * BN, "two making threads a weight row of a block");
static_assert(STAGES * DY_TILE >= TOKS * OUT_PITCH * 2, "the output tile fits in the stages");

// Where dy's tile of the cube's block `i` (counted from its first) lands: stage `i % STAGES`.
__device__ __forceinline__ u32 stage_at(u32 base, int i) { return base + (i % STAGES) * DY_TILE; }

// The value tiles of the cube's block `i`: slot `i % VALS`, after the stages; MMA warpgroup `c`'s columns
// at `+ c · VAL_TILE`.
__device__ __forceinline__ u32 values_at(u32 base, int i) { return base + STAGES * DY_TILE + (i % VALS) * 2 * VAL_TILE; }

// Where the cube's block `i`'s packed weight rows and the making threads' scales land: slot `i % W_STAGES`
// of the weight's ring, after the value tiles.
__device__ __forceinline__ u32 weights_at(u32 base, int i) { return base + STAGES * DY_TILE + VALS_BYTES + (i % W_STAGES) * W_STAGE_BYTES; }

// The mbarrier on which stage `s`'s dy tile lands, after the weight's ring.
__device__ __forceinline__ u32 landed_at(u32 base, int s) { return base + STAGES * DY_TILE + VALS_BYTES + W_STAGES * W_STAGE_BYTES + 8 * s; }

// What making thread `t` copies each block, computed once: the half `t % 2` (one MMA warpgroup's
// 64 columns, 16 bytes) of weight row `t / 2` of the block.
struct Copies {
    const unsigned char* w;  // the chunk's row in block 0
    bool w_ok;               // the chunk lies in the padded row
};

__device__ __forceinline__ Copies copies_of(const unsigned char* w, const GradParams& p, u32 c0, u32 t) {
    Copies c;
    const u32 word = c0 / 16 + 4 * (t % 2);
    c.w = w + ((u64)(t / 2) * p.row_words + word) * 4;
    c.w_ok = word < p.row_words;
    return c;
}

// Stages dy's tile of the cube's block `i` (block `nb0 + i` of the reduction): TOKS rows by BN
// columns, one tensor copy onto the stage's mbarrier.
__device__ __forceinline__ void load_dy(u32 base, const TensorMap* dy_map, u32 tok0, int nb0, int i) {
    const u32 landed = landed_at(base, i % STAGES);
    barrier_expect(landed, DY_TILE);
    tensor_copy(stage_at(base, i), dy_map, (nb0 + i) * BN, tok0, landed);
}

// Stages making thread `t`'s part of the weight of the cube's block `i` (block `nb0 + i`): its 16
// packed bytes (zeros past `n` or the padded row) and its row's scale (`cp.async`). The same
// thread expands them, so its own `cp.async` wait suffices.
__device__ __forceinline__ void load_weights(u32 base, const Copies& c, const float* w_scales, const GradParams& p, u32 t, int nb0, int i) {
    const int nb = nb0 + i;
    const u32 slot = weights_at(base, i), row = nb * BN + t / 2;
    const bool ok = row < p.n && c.w_ok;
    copy16(slot + t * 16, c.w + (u64)nb * BN * p.row_words * 4, ok ? 16 : 0);
    const u32 group = p.group == 1 ? row : (u32)__umul64hi(row, ((u64)p.magic_hi << 32) | p.magic_lo);
    copy4(slot + W_TILE + t * 4, w_scales + (row < p.n ? group : 0), row < p.n ? 4 : 0);
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

// Expands making thread `t`'s part of the cube's staged block `i` (block `nb0 + i`) into MMA warpgroup `t % 2`'s value tile
// (`[BN][64]` elements, 128-byte swizzle): row `t / 2`, four words of 16 elements, eight 16-byte
// stores. Elements `4g … 4g+3` of a word are the bytes of `(word >> 2g) & 0x03030303` (the
// packing in `mod.rs`), and `c · 0x22 + 0x10` of a code `c` is a `prmt` selector for bytes
// `2c, 2c+1` of `{−v, 0, +v, 0}`: the element `(c − 1) · v`. Rows past `n` expand to zeros.
__device__ __forceinline__ void expand(u32 base, int nb0, int i, const GradParams& p, u32 t, Magnitude& mag) {
    const int nb = nb0 + i;
    const u32 r = t / 2, slot = weights_at(base, i);
    float s;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(s) : "r"(slot + W_TILE + t * 4));
    if (s != mag.scale) {
        mag.scale = s;
        mag.bits = magnitude(s);
    }
    const u32 v = nb * BN + r < p.n ? mag.bits : 0u, lo = v ^ 0x8000u, hi = v;
    u32 word[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(word[0]), "=r"(word[1]), "=r"(word[2]), "=r"(word[3]) : "r"(slot + t * 16));
    const u32 vals = values_at(base, i) + (t % 2) * VAL_TILE + r * 128;
    #pragma unroll
    for (int q = 0; q < 4; ++q) {
        u32 e[8];
        #pragma unroll
        for (int g = 0; g < 4; ++g) {
            const u32 selector = ((word[q] >> (2 * g)) & 0x03030303u) * 0x22u + 0x10101010u;
            e[2 * g] = permute(lo, hi, selector);
            e[2 * g + 1] = permute(lo, hi, selector >> 16);
        }
        // Word q holds the warpgroup's columns 16 q …: chunks 2 q and the next.
        const u32 c = 2 * q;
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(vals + ((c ^ (r % 8)) << 4)), "r"(e[0]), "r"(e[1]), "r"(e[2]), "r"(e[3]));
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(vals + (((c + 1) ^ (r % 8)) << 4)), "r"(e[4]), "r"(e[5]), "r"(e[6]), "r"(e[7]));
    }
}

// dy_map: the tensor map of dy (dense `[m, n]`, passed as `dy` too, unread); w `[n, row_words]`
// packed words; w_scales one f32 per `group` rows; dx dense `[m, k]`. SPLITS cubes per (gradient
// tile, column tile), column tiles fastest; THREADS threads, KILN_SHARED_BYTES of shared memory.
extern "C" __global__ void KILN_CLUSTER __launch_bounds__(THREADS, 1) kiln_ternary_input_grad(
    const __grid_constant__ TensorMap dy_map, const out_t* __restrict__ dy, const unsigned char* __restrict__ w, const float* __restrict__ w_scales,
    out_t* __restrict__ dx, const __grid_constant__ GradParams p) {
    extern __shared__ unsigned char shared_raw[];
    const u32 base = (shared_address(shared_raw) + 1023) & ~1023u;
    const u32 col_tiles = (p.k + COLS - 1) / COLS, cube_tile = blockIdx.x / SPLITS, tok0 = (cube_tile / col_tiles) * TOKS, c0 = (cube_tile % col_tiles) * COLS;
    // This cube's share of the reduction's blocks: [nb0, nb0 + blocks).
    const int all = (p.n + BN - 1) / BN, rank = blockIdx.x % SPLITS;
    const int nb0 = all * rank / SPLITS, blocks = all * (rank + 1) / SPLITS - nb0;
    // The warpgroup, taken from lane 0 so that the compiler sees it uniform across a warp.
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) barrier_init(landed_at(base, s));
        barrier_init_fence();
    }
    __syncthreads();
    const out_t* tile = reinterpret_cast<const out_t*>(shared_raw + (base - shared_address(shared_raw)));
    if (wg == 0) {
        const u32 t = threadIdx.x;
        const Copies c = copies_of(w, p, c0, t);
        Magnitude mag;
        #pragma unroll
        for (int i = 0; i < STAGES - 2; ++i)
            if (t == 0 && i < blocks) load_dy(base, &dy_map, tok0, nb0, i);
        #pragma unroll
        for (int i = 0; i < W_LEAD; ++i) {
            if (i < blocks) load_weights(base, c, w_scales, p, t, nb0, i);
            copy_commit();
        }
        copy_wait<W_LEAD - 1>();
        expand(base, nb0, 0, p, t, mag);
        for (int i = 0; i < blocks; ++i) {
            async_proxy_fence();  // the expanded values, before the barrier shows them to wgmma
            role_sync<THREADS>();
            if (t == 0 && i + STAGES - 2 < blocks) load_dy(base, &dy_map, tok0, nb0, i + STAGES - 2);
            if (i + W_LEAD < blocks) load_weights(base, c, w_scales, p, t, nb0, i + W_LEAD);
            copy_commit();
            copy_wait<W_LEAD - 1>();
            if (i + 1 < blocks) expand(base, nb0, i + 1, p, t, mag);
        }
        if (makers_finish<THREADS, SPLITS>(rank)) return;
    } else {
        const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, c = wg - 1;
        float acc[ACC];
        #pragma unroll
        for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
        for (int i = 0; i < blocks; ++i) {
            role_sync<THREADS>();
            barrier_wait(landed_at(base, i % STAGES), (i / STAGES) & 1);
            // Descriptors of the block's first k16 step; a step advances A by 16 rows of 128 bytes
            // and B by 32 bytes (the descriptors count 16-byte units).
            const u64 a = descriptor(values_at(base, i) + c * VAL_TILE, BN * 128, 1024), b = descriptor(stage_at(base, i), 16, 1024);
            wgmma_fence();
            #pragma unroll
            for (int s = 0; s < BN / 16; ++s) WGMMA_MA(acc, a + s * (16 * 128 / 16), b + s * (32 / 16), 1);
            wgmma_commit();
            wgmma_wait<1>();
        }
        wgmma_wait<0>();
        fence_accumulators(acc);
        role_sync<THREADS>();
#if SPLITS > 1
        static_assert(ACC * MMA_THREADS * 4 <= STAGES * DY_TILE, "the split sums fit in the stages");
        if (gather_splits<MMA_THREADS>(acc, base, rank, SPLITS, threadIdx.x - MAKERS)) return;
#endif
        // Round into the output tile `[TOKS][OUT_PITCH]` in shared memory: acc[4j + 2h + e] is
        // gradient row 8j + 2t + e, weight column `col + 8h`. (The `+ 0.f` keeps ptxas from
        // serializing the wgmmas: converting an accumulator register straight to 16 bits made it
        // report C7514 and wait after every MMA.)
        stage_pairs_transposed<TOKS / 8>(base, OUT_PITCH, c * 64 + warp * 16, lane, [&](int j, int h) { return kiln_out2(acc[4 * j + 2 * h] + 0.f, acc[4 * j + 2 * h + 1] + 0.f); });
        role_sync<THREADS>();
    }
    store_tile<TOKS, COLS, THREADS>(dx, tile, OUT_PITCH, p.m, p.k, tok0, c0);
}
