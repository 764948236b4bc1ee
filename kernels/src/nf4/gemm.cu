// The NF4/FP4 GEMM on Hopper's warpgroup MMA: `out[m, n] = Σ_k x[m, k] · w̃[n, k]` for f16/bf16
// activations `x` and a 4-bit weight in bitsandbytes' layout, without writing the dequantized
// weight anywhere. `w̃ = out_t(code[q(n, k)] · scale(n, k))`, the product in f32 rounded once, as
// bitsandbytes dequantizes. kiln places `hopper/common.cuh`, `hopper/wgmma.cuh` and
// `cuda_out.cuh` before this source.
//
// Layout (`kernels/src/nf4/mod.rs`): two codes a byte, the even element in the high nibble, the
// weight row-major; one scale per block of `block` elements (a power of two, 64 or more) and `k` a
// multiple of 64, so that each row's run of 64 elements is 32 contiguous bytes under one scale.
// Scales are an f32 absmax per block, or with double quantization `nested_code[q] ·
// nested_absmax[b / 256] + offset`, the product and the sum each rounded (no fused multiply-add).
//
// As an MMA it is `outᵀ = w̃ · xᵀ`: a cube takes FEATS = 128 weight rows by TOKS = 256 activation
// rows, k in blocks of BK = 64, and is three warpgroups.
// - The first copies: one thread issues x's tensor copies (`x_map`: TOKS × 64 boxes, 128-byte
//   swizzle, zeros past `m`) onto each stage's mbarrier; each thread copies one weight row's 32
//   packed bytes and scale parts (`cp.async`, W_LEAD blocks ahead) and, T_LEAD blocks ahead of the
//   MMAs, stages the row's scaled code book: 16 values `out_t(code[i] · s)` split into a low-byte and
//   a high-byte plane (16 bytes each), one multiply per entry instead of one per element.
// - The other two (64 weight rows each) make their own A operand in registers and issue
//   `wgmma` with A from registers and x's tile as B (K-major). A's fragment of an m64k16 step:
//   thread (g = lane / 4, c = lane % 4) of warp w holds rows 16w + g and 16w + g + 8 at k = 2c,
//   2c + 1 and 2c + 8, 2c + 9, which are byte c of the step's two packed words of each row: four
//   codes. Each code's value is two `prmt` lookups in the row's planes (its low three bits pick a
//   byte of two registers, its high bit one of the two results), so a step's four registers cost
//   16 `prmt` and no shared-memory lookup.
//
// Measured on the H200 (`benches/RESULTS.md`, fifty-first session): 0.82–0.87× torch's bf16 GEMM
// on the dequantized weight from M = 2048. Value tiles written and read through shared memory (the
// thirty-seventh session's probe, `benches/probes/nf4_gemm.cu` at 4f4e2a6) ran 0.74× this kernel's
// speed, 0.82× with its lookups by `prmt`; the selectors staged by the first warpgroup, 0.90×.
//
// Step kb: one cube barrier (named barrier 1, reached from each role's own loop: a branch on the
// role inside one loop makes ptxas serialize the wgmmas) publishes block kb's weight bytes and
// tables; the MMA warpgroups load their two rows' planes and words, and for each k16 step retire
// the previous block's MMA of the same step (`wgmma.wait_group 3`: three steps stay in flight), make
// its four registers and issue it. The first warpgroup meanwhile refills x's stage two blocks ahead,
// the weight ring W_LEAD blocks ahead, and stages block kb + T_LEAD's tables.
//
// Split k (KILN_SPLITS = 2 or 3, where a launch has too few tiles to fill the SMs): the SPLITS cubes
// of a tile form one thread-block cluster, each runs its share of k's blocks, and the tile's first
// cube adds the others' f32 sums (in rank order) through distributed shared memory
// (`gather_splits`) before its epilogue.
//
// Defines: KILN_OUT_KIND (1 f16, 2 bf16: x and out share it), KILN_WGMMA_TYPE ("f16", "bf16"),
// KILN_NESTED (1: double-quantized scales), KILN_SPLITS (1, 2, 3).

#define FEATS 128
#define TOKS 256
#define BK 64
#define STAGES 4
#define W_STAGES 8
#define W_LEAD 6
// Table slots, and how many blocks ahead of the MMAs the first warpgroup stages them.
#define VALS 3
#define T_LEAD (VALS - 1)
#define GROUP 8
#define THREADS 384
#define MMA_THREADS 256
// Registers a thread after the warpgroups' `setmaxnreg`: the MMA threads hold 128 accumulators and
// their A fragments (ptxas otherwise serializes the wgmmas, C7512).
#define MAKER_REGS 56
#define MMA_REGS 224
#define SPLITS KILN_SPLITS
#define X_TILE (TOKS * BK * 2)
#define W_TILE (FEATS * BK / 2)
// Each row's scale parts of a block: the f32 absmax, or the 8-bit code's word and the nested
// absmax.
#define SCALE_TILE (2 * FEATS * 4)
#define W_STAGE_BYTES (W_TILE + SCALE_TILE)
// A block's tables: FEATS rows of two 16-byte planes.
#define TABLE_TILE (FEATS * 32)
#define OUT_PITCH (FEATS + 8)
// Bytes of dynamic shared memory the launch requests: x's stages, the table slots, the weight's
// ring, the stages' mbarriers, and 1 KB to align the swizzled tiles.
#define KILN_SHARED_BYTES (STAGES * X_TILE + VALS * TABLE_TILE + W_STAGES * W_STAGE_BYTES + STAGES * 8 + 1024)

struct GemmParams {
    u32 m;      // activation rows
    u32 n;      // weight rows (output features)
    u32 k;      // the reduction, a multiple of 64
    u32 shift;  // log2(block)
};

static_assert(sizeof(out_t) == 2, "f16 or bf16 outputs");
static_assert(STAGES * X_TILE >= TOKS * OUT_PITCH * 2, "the output tile fits in the stages");
static_assert(STAGES * X_TILE >= TOKS / 2 * MMA_THREADS * 4, "the split sums fit in the stages");
static_assert(THREADS - MMA_THREADS == FEATS, "one copying thread a weight row");
static_assert(MAKER_REGS * (THREADS - MMA_THREADS) + MMA_REGS * MMA_THREADS <= 65536, "the register file");

// Where x's tile of the cube's block `kb` lands: stage `kb % STAGES`.
__device__ __forceinline__ u32 stage_at(u32 base, int kb) { return base + (kb % STAGES) * X_TILE; }

// The tables of block `kb`: slot `kb % VALS`, after the stages.
__device__ __forceinline__ u32 tables_at(u32 base, int kb) { return base + STAGES * X_TILE + (kb % VALS) * TABLE_TILE; }

// Where row `f`'s byte plane `h` (0 low, 1 high) sits in a slot: the halves swapped every four rows,
// so that eight consecutive rows' stores hit distinct banks.
__device__ __forceinline__ u32 plane_at(u32 slot, u32 f, u32 h) { return slot + f * 32 + ((h ^ ((f >> 2) & 1)) << 4); }

// Where the packed weight and the scale parts of block `kb` land: slot `kb % W_STAGES` of the
// weight's ring, after the table slots.
__device__ __forceinline__ u32 weights_at(u32 base, int kb) { return base + STAGES * X_TILE + VALS * TABLE_TILE + (kb % W_STAGES) * W_STAGE_BYTES; }

// The mbarrier on which stage `s`'s x tile lands, after the weight's ring.
__device__ __forceinline__ u32 landed_at(u32 base, int s) { return base + STAGES * X_TILE + VALS * TABLE_TILE + W_STAGES * W_STAGE_BYTES + 8 * s; }

// The block (scale index) of row `f`'s elements from `col` on.
__device__ __forceinline__ u64 block_of(u32 f, u32 col, const GemmParams& p) { return ((u64)f * p.k + col) >> p.shift; }

struct Scales {
    const float* __restrict__ absmax;  // per block, or per 256 blocks when nested
    const u32* __restrict__ codes;     // nested: the blocks' 8-bit codes, four a word
};

// Stages x's tile of the cube's block `kb` (block `kb0 + kb` of k): TOKS rows by BK columns, one
// tensor copy onto the stage's mbarrier, zeros past `m`.
__device__ __forceinline__ void load_x(u32 base, const TensorMap* x_map, u32 tok0, int kb0, int kb) {
    const u32 landed = landed_at(base, kb % STAGES);
    barrier_expect(landed, X_TILE);
    tensor_copy(stage_at(base, kb), x_map, (kb0 + kb) * BK, tok0, landed);
}

// Stages copying thread `row`'s weight row of block `kb`: its 32 packed bytes and its scale parts
// (`cp.async`), zeros past `n`. The thread's `cp.async` wait and the next cube barrier publish them.
__device__ __forceinline__ void load_weights(u32 base, u32 row, const unsigned char* w, const Scales& s, const GemmParams& p, u32 f0, int kb0, int kb) {
    const u32 slot = weights_at(base, kb), col = (kb0 + kb) * BK, f = f0 + row;
    const bool ok = f < p.n;
    const unsigned char* src = ok ? w + ((u64)f * p.k + col) / 2 : w;
    copy16(slot + row * 32, src, ok ? 16 : 0);
    copy16(slot + row * 32 + 16, src + 16, ok ? 16 : 0);
    const u64 b = block_of(ok ? f : 0, col, p);
#if KILN_NESTED
    copy4(slot + W_TILE + row * 4, s.codes + b / 4, ok ? 4 : 0);
    copy4(slot + W_TILE + FEATS * 4 + row * 4, s.absmax + b / 256, ok ? 4 : 0);
#else
    copy4(slot + W_TILE + row * 4, s.absmax + b, ok ? 4 : 0);
#endif
}

// The code book (16 f32) and, nested, the 256-entry nested code book and the offset, in static
// shared memory.
struct Books {
    float code[16];
#if KILN_NESTED
    float nested[256];
    float offset;
#endif
};

// The scale of tile row `row` in staged block `kb` (a row past `n` gets whatever its zeroed parts
// give: its outputs are never stored).
__device__ __forceinline__ float scale_of(const Books& books, u32 base, int kb0, int kb, u32 row, u32 f0, const GemmParams& p) {
    const u32 parts = weights_at(base, kb) + W_TILE;
    u32 first;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(first) : "r"(parts + row * 4));
#if KILN_NESTED
    float nested_absmax;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(nested_absmax) : "r"(parts + FEATS * 4 + row * 4));
    const u32 q = (first >> (8 * (u32)(block_of(f0 + row, (kb0 + kb) * BK, p) % 4))) & 0xffu;
    return __fadd_rn(__fmul_rn(books.nested[q], nested_absmax), books.offset);
#else
    return __uint_as_float(first);
#endif
}

// A row's code book scaled by its block's scale and rounded to out_t, split into byte planes for
// `prmt` lookups: lo[q] holds the low bytes of entries 4q … 4q + 3, hi[q] their high bytes.
struct Table {
    u32 lo[4], hi[4];
};

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// Entry i of the scaled code book is out_t(code[i] · s), rounded once from f32, as bitsandbytes
// dequantizes.
__device__ __forceinline__ Table scaled_table(const float (&code)[16], float s) {
    Table t;
    #pragma unroll
    for (int q = 0; q < 4; ++q) {
        const u32 a = kiln_out2(__fmul_rn(code[4 * q], s), __fmul_rn(code[4 * q + 1], s));
        const u32 b = kiln_out2(__fmul_rn(code[4 * q + 2], s), __fmul_rn(code[4 * q + 3], s));
        t.lo[q] = prmt(a, b, 0x6420);
        t.hi[q] = prmt(a, b, 0x7531);
    }
    return t;
}

// The values of the four codes of a packed byte pair `v` (byte 0 at k, k + 1: high nibble first;
// byte 1 at k + 8, k + 9), as A's two registers (k, k + 1) and (k + 8, k + 9), the first element
// of each in the low half. `prmt` selects a byte of two registers by the low three bits of each
// selector nibble, so the low three bits of the codes pick within each half of a plane and their
// high bits pick between the halves' results; the bytes come out in nibble order (k + 1, k, k + 9,
// k + 8) and the last two `prmt` pair them up in k order.
__device__ __forceinline__ void look_up(const Table& t, u32 v, u32& pair0, u32& pair1) {
    const u32 low3 = v & 0x7777u, pick = ((v >> 1) & 0x4444u) | 0x3210u;
    const u32 lo = prmt(prmt(t.lo[0], t.lo[1], low3), prmt(t.lo[2], t.lo[3], low3), pick);
    const u32 hi = prmt(prmt(t.hi[0], t.hi[1], low3), prmt(t.hi[2], t.hi[3], low3), pick);
    pair0 = prmt(lo, hi, 0x4051);
    pair1 = prmt(lo, hi, 0x6273);
}

// Stages copying thread `row`'s scaled code book of block `kb` (its two planes).
__device__ __forceinline__ void stage_table(const Books& books, const float (&code)[16], u32 base, int kb0, int kb, u32 row, u32 f0, const GemmParams& p) {
    const Table t = scaled_table(code, scale_of(books, base, kb0, kb, row, f0, p));
    const u32 slot = tables_at(base, kb);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(plane_at(slot, row, 0)), "r"(t.lo[0]), "r"(t.lo[1]), "r"(t.lo[2]), "r"(t.lo[3]));
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(plane_at(slot, row, 1)), "r"(t.hi[0]), "r"(t.hi[1]), "r"(t.hi[2]), "r"(t.hi[3]));
}

// Tile row `f`'s staged planes and packed words of block `kb`, as an MMA thread loads them.
__device__ __forceinline__ void load_row(u32 base, int kb, u32 f, Table& t, u32 (&word)[8]) {
    const u32 slot = tables_at(base, kb), src = weights_at(base, kb) + f * 32;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(t.lo[0]), "=r"(t.lo[1]), "=r"(t.lo[2]), "=r"(t.lo[3]) : "r"(plane_at(slot, f, 0)));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(t.hi[0]), "=r"(t.hi[1]), "=r"(t.hi[2]), "=r"(t.hi[3]) : "r"(plane_at(slot, f, 1)));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(word[0]), "=r"(word[1]), "=r"(word[2]), "=r"(word[3]) : "r"(src));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(word[4]), "=r"(word[5]), "=r"(word[6]), "=r"(word[7]) : "r"(src + 16));
}

// The copying warpgroup's part: x's stages, the weight's ring and the tables, block by block in
// step with the MMA warpgroups' barriers.
__device__ __forceinline__ void copy_blocks(const Books& books, u32 base, const TensorMap* x_map, const unsigned char* w, const Scales& s, const GemmParams& p, u32 tok0, u32 f0, int kb0, int blocks) {
    const u32 row = threadIdx.x;
    float code[16];
    #pragma unroll
    for (int i = 0; i < 16; ++i) code[i] = books.code[i];
    #pragma unroll
    for (int kb = 0; kb < STAGES - 2; ++kb)
        if (threadIdx.x == 0 && kb < blocks) load_x(base, x_map, tok0, kb0, kb);
    #pragma unroll
    for (int kb = 0; kb < W_LEAD; ++kb) {
        if (kb < blocks) load_weights(base, row, w, s, p, f0, kb0, kb);
        copy_commit();
    }
    copy_wait<W_LEAD - T_LEAD>();
    #pragma unroll
    for (int kb = 0; kb < T_LEAD; ++kb)
        if (kb < blocks) stage_table(books, code, base, kb0, kb, row, f0, p);
    for (int kb = 0; kb < blocks; ++kb) {
        role_sync<THREADS>();
        if (threadIdx.x == 0 && kb + STAGES - 2 < blocks) load_x(base, x_map, tok0, kb0, kb + STAGES - 2);
        if (kb + W_LEAD < blocks) load_weights(base, row, w, s, p, f0, kb0, kb + W_LEAD);
        copy_commit();
        copy_wait<W_LEAD - T_LEAD>();
        if (kb + T_LEAD < blocks) stage_table(books, code, base, kb0, kb + T_LEAD, row, f0, p);
    }
}

// An MMA warpgroup's part: the MMAs of every block into `acc` (its 64 rows by TOKS tokens).
__device__ __forceinline__ void multiply_blocks(float (&acc)[TOKS / 2], u32 base, int blocks, int c, int warp, int lane) {
    const u32 f = c * 64 + warp * 16 + lane / 4, t4 = lane % 4;
    // prmt selector of byte t4 of two words: a k16 step's two bytes of this thread's codes
    const u32 gather = t4 | ((t4 + 4) << 4);
    u32 a[4][4] = {};
    for (int kb = 0; kb < blocks; ++kb) {
        role_sync<THREADS>();
        Table t0, t1;
        u32 w0[8], w1[8];
        load_row(base, kb, f, t0, w0);
        load_row(base, kb, f + 8, t1, w1);
        barrier_wait(landed_at(base, kb % STAGES), (kb / STAGES) & 1);
        const u64 b = descriptor(stage_at(base, kb), 16, 1024);
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            wgmma_wait<3>();
            keep_operands(a[j]);
            look_up(t0, prmt(w0[2 * j], w0[2 * j + 1], gather), a[j][0], a[j][2]);
            look_up(t1, prmt(w1[2 * j], w1[2 * j + 1], gather), a[j][1], a[j][3]);
            wgmma_fence();
            wgmma_rs_k_n256(acc, a[j][0], a[j][1], a[j][2], a[j][3], b + j * 2);
            wgmma_commit();
        }
    }
    wgmma_wait<0>();
    #pragma unroll
    for (int j = 0; j < 4; ++j) keep_operands(a[j]);
    fence_accumulators(acc);
}

// x_map: the tensor map of x (dense `[m, k]`, passed as `x` too, unread); w the packed codes;
// code the 16-entry code book; absmax, absmax_codes, nested_code, offset the scales (`Scales`;
// plain absmax binds it in the unread nested slots); out dense `[m, n]`. SPLITS cubes per
// (activation tile, weight tile); THREADS threads, KILN_SHARED_BYTES of shared memory.
extern "C" __global__ void KILN_CLUSTER __launch_bounds__(THREADS, 1) kiln_nf4_gemm(
    const __grid_constant__ TensorMap x_map, const out_t* __restrict__ x, const unsigned char* __restrict__ w, const float* __restrict__ code,
    const float* __restrict__ absmax, const u32* __restrict__ absmax_codes, const float* __restrict__ nested_code, const float* __restrict__ offset,
    out_t* __restrict__ out, const __grid_constant__ GemmParams p) {
    extern __shared__ unsigned char shared_raw[];
    __shared__ Books books;
    const u32 base = (shared_address(shared_raw) + 1023) & ~1023u;
    u32 tok0, f0;
    grouped_tile<TOKS, FEATS, GROUP>(blockIdx.x / SPLITS, p.m, p.n, tok0, f0);
    // This cube's share of k's blocks: [kb0, kb0 + blocks).
    const int all = p.k / BK, rank = blockIdx.x % SPLITS;
    const int kb0 = all * rank / SPLITS, blocks = all * (rank + 1) / SPLITS - kb0;
    // The warpgroup, taken from lane 0 so that the compiler sees it uniform across a warp.
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    if (threadIdx.x < 16) books.code[threadIdx.x] = code[threadIdx.x];
#if KILN_NESTED
    if (threadIdx.x < 256) books.nested[threadIdx.x] = nested_code[threadIdx.x];
    if (threadIdx.x == 0) books.offset = *offset;
#endif
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; ++i) barrier_init(landed_at(base, i));
        barrier_init_fence();
    }
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(MAKER_REGS));
        copy_blocks(books, base, &x_map, w, Scales{absmax, absmax_codes}, p, tok0, f0, kb0, blocks);
        if (makers_finish<THREADS, SPLITS>(rank)) return;
    } else {
        // The accumulators live only here, so the copying warpgroup's region needs none.
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(MMA_REGS));
        const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, c = wg - 1;
        float acc[TOKS / 2];
        #pragma unroll
        for (int i = 0; i < TOKS / 2; ++i) acc[i] = 0.f;
        multiply_blocks(acc, base, blocks, c, warp, lane);
        role_sync<THREADS>();  // every MMA is done reading the stages: the split sums and the output tile reuse them
#if SPLITS > 1
        if (gather_splits<MMA_THREADS>(acc, base, rank, SPLITS, threadIdx.x - FEATS)) return;
#endif
        // Round into the output tile `[TOKS][OUT_PITCH]` in shared memory: acc[4j + 2h + e] is token
        // 8j + 2t + e, weight row `first + lane / 4 + 8h`. (The `+ 0.f`: see `ternary/grad.cu`.)
        stage_pairs_transposed<TOKS / 8>(base, OUT_PITCH, c * 64 + warp * 16, lane, [&](int j, int h) { return kiln_out2(acc[4 * j + 2 * h] + 0.f, acc[4 * j + 2 * h + 1] + 0.f); });
        role_sync<THREADS>();  // the output tile is staged
    }
    const out_t* tile = reinterpret_cast<const out_t*>(shared_raw + (base - shared_address(shared_raw)));
    store_tile<TOKS, FEATS, THREADS>(out, tile, OUT_PITCH, p.m, p.n, tok0, f0);
}
