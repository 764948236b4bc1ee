// Probe (not part of kiln's build): an NF4/FP4 GEMM on Hopper's warpgroup MMA that dequantizes
// in its main loop, `out[m, n] = Σ_k x[m, k] · w̃[n, k]` with `w̃ = code[q(n, k)] · scale(n, k)` in
// f32 rounded to x's type (bitsandbytes' dequantization, exactly), measured against kiln's
// dequantize-then-cuBLASLt path by `nf4_gemm.py`. It is exact (within the error rule of cuBLAS on
// the dequantized weight) but runs 490–540 TF/s on the H100, 0.62–0.68× torch's bf16 GEMM, where
// the two-pass path reaches ~600 TF/s from M = 2048; at M = 512 it matches the two-pass path's
// device time (`benches/RESULTS.md`, thirty-seventh session, has every variant). kiln's kernel,
// `kernels/src/nf4/gemm.cu` (fifty-first session), makes the weight's operand in registers by
// `prmt` lookups in a scaled code book instead.
//
// Layout (`kernels/src/nf4/mod.rs`): bitsandbytes' bytes, two codes a byte, the even element in
// the high nibble, the weight flattened row-major; one scale per block of `block` elements (a
// power of two, 64 or more) and `k` a multiple of 64, so that each row's run of 64 elements is 32
// contiguous bytes under one scale. Scales are an f32 absmax per block, or with double
// quantization `nested_code[q] · nested_absmax[b / 256] + offset`, the product and the sum each
// rounded (as bitsandbytes computes them: no fused multiply-add).
//
// As an MMA it is `outᵀ = w̃ · xᵀ`: a cube takes FEATS = 128 weight rows by TOKS = 256 activation
// rows, k in blocks of BK = 64, both operands K-major, and is three warpgroups. The first makes
// the operands: one thread issues x's tensor copies (`x_map`: TOKS × 64 boxes, 128-byte swizzle,
// zeros past `m`) onto each stage's mbarrier, and each thread copies one weight row's packed
// bytes and scale parts (`cp.async`, W_LEAD blocks ahead) and expands the row into the value
// tiles (`[64][64]` elements, 128-byte swizzle): a lookup in the f32 code book in shared memory
// (16 words in 16 banks: a warp's lookups never conflict), a multiply by the row's scale, and one
// conversion a pair. The other two (M = 64 rows each) only run the MMAs. What bounds it: the
// 64 lookups a row and block (8192 `ld.shared` a block of the cube) on top of the MMAs' own
// shared-memory reads; without them (multiplying the nibbles instead) the same kernel ran
// 610–680 TF/s, and without any expansion 675–720.
//
// Step kb: one cube barrier (named barrier 1, reached from each role's own loop: a branch on the
// role inside one loop made ptxas serialize the wgmmas, C7518) publishes block kb's values
// (expanded in step kb − 1) and retires the MMAs of block kb − 2 (so its x stage and value tile
// are free); the MMA warpgroups wait for x's tile, issue the block's four k16 MMAs and retire
// block kb − 1's, while the first warpgroup refills x's stage two blocks ahead and the weight
// ring W_LEAD blocks ahead, then expands block kb + 1 into the third of the VALS value tiles.
// Cubes walk the tiles in groups of GROUP activation tiles, the weight's tiles in order within a
// group, so a group's activations stay in L2 while the packed weight streams past.
//
// Split k (KILN_SPLITS = 2 or 3, where a launch has too few tiles to fill the SMs): the SPLITS
// cubes of a tile form one thread-block cluster, each runs its share of k's blocks, and the tile's
// first cube adds the others' f32 sums (in rank order) through distributed shared memory
// (`gather_splits`) before its epilogue.
//
// Defines: KILN_OUT_KIND (1 f16, 2 bf16: x and out share it), KILN_WGMMA_TYPE ("f16", "bf16"),
// KILN_NESTED (1: double-quantized scales), KILN_SPLITS (1, 2, 3). The probe places
// `hopper/common.cuh`, `hopper/wgmma.cuh` and `cuda_out.cuh` before this source.

#define FEATS 128
#define TOKS 256
#define BK 64
#define STAGES 4
#define W_STAGES 8
#define W_LEAD 6
#define VALS 3
#define GROUP 8
#define THREADS 384
#define MMA_THREADS 256
#define SPLITS KILN_SPLITS
#define X_TILE (TOKS * BK * 2)
#define W_TILE (FEATS * BK / 2)
// Each row's scale parts of a block: the f32 absmax, or the 8-bit code's word and the nested
// absmax.
#define SCALE_TILE (2 * FEATS * 4)
#define W_STAGE_BYTES (W_TILE + SCALE_TILE)
// An MMA warpgroup's 64 rows of one expanded block (its A operand); a slot holds both.
#define VAL_TILE (64 * BK * 2)
#define VALS_BYTES (VALS * 2 * VAL_TILE)
#define OUT_PITCH (FEATS + 8)
// Bytes of dynamic shared memory the launch requests: x's stages, the value tiles, the weight's
// ring, the stages' mbarriers, and 1 KB to align the swizzled tiles.
#define KILN_SHARED_BYTES (STAGES * X_TILE + VALS_BYTES + W_STAGES * W_STAGE_BYTES + STAGES * 8 + 1024)

// A CUDA tensor map (`CUtensorMap`), opaque to the kernel; CubeCL encodes it at launch.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

struct GemmParams {
    u32 m;      // activation rows
    u32 n;      // weight rows (output features)
    u32 k;      // the reduction, a multiple of 64
    u32 shift;  // log2(block)
};

static_assert(sizeof(out_t) == 2, "f16 or bf16 outputs");
static_assert(STAGES * X_TILE >= TOKS * OUT_PITCH * 2, "the output tile fits in the stages");
static_assert(STAGES * X_TILE >= 128 * MMA_THREADS * 4, "the split sums fit in the stages");
static_assert(THREADS - MMA_THREADS == FEATS, "one expanding thread a weight row");

// Where x's tile of the cube's block `kb` lands: stage `kb % STAGES`.
__device__ __forceinline__ u32 stage_at(u32 base, int kb) { return base + (kb % STAGES) * X_TILE; }

// The value tiles of block `kb`: slot `kb % VALS`, after the stages; MMA warpgroup `c`'s rows at
// `+ c · VAL_TILE`.
__device__ __forceinline__ u32 values_at(u32 base, int kb) { return base + STAGES * X_TILE + (kb % VALS) * 2 * VAL_TILE; }

// Where the packed weight and the scale parts of block `kb` land: slot `kb % W_STAGES` of the
// weight's ring, after the value tiles.
__device__ __forceinline__ u32 weights_at(u32 base, int kb) { return base + STAGES * X_TILE + VALS_BYTES + (kb % W_STAGES) * W_STAGE_BYTES; }

// The mbarrier on which stage `s`'s x tile lands, after the weight's ring.
__device__ __forceinline__ u32 landed_at(u32 base, int s) { return base + STAGES * X_TILE + VALS_BYTES + W_STAGES * W_STAGE_BYTES + 8 * s; }

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
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(stage_at(base, kb)),
                 "l"(x_map), "r"((kb0 + kb) * BK), "r"(tok0), "r"(landed) : "memory");
}

// Stages expanding thread `row`'s weight row of block `kb`: its 32 packed bytes and its scale parts
// (`cp.async`), zeros past `n`. The same thread expands it, so its own `cp.async` wait suffices.
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

// The code book's entry at byte offset `offset` (4 × the code).
__device__ __forceinline__ float lookup(const Books& books, u32 offset) { return *reinterpret_cast<const float*>(reinterpret_cast<const char*>(books.code) + offset); }

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

// Expands tile row `row` of staged block `kb` into its MMA warpgroup's value tile: 64 elements,
// two 16-byte loads and eight 16-byte stores. Byte `j` of a packed word holds elements 2j (high
// nibble) and 2j + 1 (low nibble), which become one packed pair, the lower element in the low
// half; `(w >> 2) & 0x3c3c3c3c` and `(w << 2) & 0x3c3c3c3c` hold the code book's byte offsets of a
// word's high and low nibbles, one byte each.
__device__ __forceinline__ void expand(const Books& books, u32 base, int kb0, int kb, u32 row, u32 f0, const GemmParams& p) {
    const float s = scale_of(books, base, kb0, kb, row, f0, p);
    const u32 r = row % 64, tile = values_at(base, kb) + (row / 64) * VAL_TILE + r * 128;
    u32 word[8];
    const u32 src = weights_at(base, kb) + row * 32;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(word[0]), "=r"(word[1]), "=r"(word[2]), "=r"(word[3]) : "r"(src));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(word[4]), "=r"(word[5]), "=r"(word[6]), "=r"(word[7]) : "r"(src + 16));
    #pragma unroll
    for (int q = 0; q < 8; ++q) {
        const u32 even = (word[q] >> 2) & 0x3c3c3c3cu, odd = (word[q] << 2) & 0x3c3c3c3cu;
        u32 e[4];
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            e[j] = kiln_out2(__fmul_rn(lookup(books, __byte_perm(even, 0, 0x4440 + j)), s), __fmul_rn(lookup(books, __byte_perm(odd, 0, 0x4440 + j)), s));
        // Word q holds columns 8q …: chunk q of the 128-byte row.
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(tile + ((q ^ (r % 8)) << 4)), "r"(e[0]), "r"(e[1]), "r"(e[2]), "r"(e[3]));
    }
}

// x_map: the tensor map of x (dense `[m, k]`, passed as `x` too, unread); w the packed codes;
// code the 16-entry code book; absmax, codes, nested_code, offset the scales (`Scales`; plain
// absmax binds it in the unread nested slots); out dense `[m, n]`. SPLITS cubes per (activation
// tile, weight tile); THREADS threads, KILN_SHARED_BYTES of shared memory.
#if SPLITS > 1
#define CLUSTER __cluster_dims__(SPLITS, 1, 1)
#else
#define CLUSTER
#endif
extern "C" __global__ void CLUSTER __launch_bounds__(THREADS, 1) kiln_nf4_gemm(
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
    // The warpgroup, taken from lane 0 so that the compiler sees it uniform across a warp (a
    // branch on `threadIdx.x` made ptxas serialize the wgmmas: C7518, "divergent path").
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    const bool maker = wg == 0;  // the first warpgroup: copies and expansion
    const u32 row = threadIdx.x;             // a maker's weight row in the tile
    const Scales s{absmax, absmax_codes};
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
    if (maker) {
        #pragma unroll
        for (int kb = 0; kb < STAGES - 2; ++kb)
            if (threadIdx.x == 0 && kb < blocks) load_x(base, &x_map, tok0, kb0, kb);
        #pragma unroll
        for (int kb = 0; kb < W_LEAD; ++kb) {
            if (kb < blocks) load_weights(base, row, w, s, p, f0, kb0, kb);
            copy_commit();
        }
        copy_wait<W_LEAD - 1>();
        expand(books, base, kb0, 0, row, f0, p);
    }

    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, c = wg - 1;  // c: the MMA warpgroup
    float acc[128];
    #pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    if (maker) {
        for (int kb = 0; kb < blocks; ++kb) {
            async_proxy_fence();
            role_sync<THREADS>();
            if (threadIdx.x == 0 && kb + STAGES - 2 < blocks) load_x(base, &x_map, tok0, kb0, kb + STAGES - 2);
            if (kb + W_LEAD < blocks) load_weights(base, row, w, s, p, f0, kb0, kb + W_LEAD);
            copy_commit();
            copy_wait<W_LEAD - 1>();
            if (kb + 1 < blocks) expand(books, base, kb0, kb + 1, row, f0, p);
        }
    } else {
        for (int kb = 0; kb < blocks; ++kb) {
            role_sync<THREADS>();
            barrier_wait(landed_at(base, kb % STAGES), (kb / STAGES) & 1);
            const u64 a = descriptor(values_at(base, kb) + c * VAL_TILE, 16, 1024), b = descriptor(stage_at(base, kb), 16, 1024);
            wgmma_fence();
            #pragma unroll
            for (int k16 = 0; k16 < BK / 16; ++k16) wgmma_ss_n256(acc, a + k16 * 2, b + k16 * 2, 1);
            wgmma_commit();
            wgmma_wait<1>();
        }
        wgmma_wait<0>();
        fence_accumulators(acc);
    }
    copy_wait<0>();
    __syncthreads();  // every MMA is done reading the stages: the split sums and the output tile reuse them
#if SPLITS > 1
    if (maker ? gather_splits_idle(rank) : gather_splits<MMA_THREADS>(acc, base, rank, SPLITS, threadIdx.x - FEATS)) return;
#endif

    // Round into the output tile `[TOKS][OUT_PITCH]` in shared memory: acc[4j + 2h + e] is token
    // 8j + 2t + e, weight row `first + lane / 4 + 8h`. (The `+ 0.f`: see `ternary/grad.cu`.)
    if (!maker)
        stage_pairs_transposed<TOKS / 8>(base, OUT_PITCH, c * 64 + warp * 16, lane, [&](int j, int h) { return kiln_out2(acc[4 * j + 2 * h] + 0.f, acc[4 * j + 2 * h + 1] + 0.f); });
    __syncthreads();
    const out_t* tile = reinterpret_cast<const out_t*>(shared_raw + (base - shared_address(shared_raw)));
    store_tile<TOKS, FEATS, THREADS>(out, tile, OUT_PITCH, p.m, p.n, tok0, f0);
}
