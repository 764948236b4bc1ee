// A LoRA layer's base product and its rank-r update as one GEMM on Hopper's warpgroup MMA:
// `out[m, n] = Σ_k x[m, k] · W(n, k) + Σ_j l[m, j] · R(n, j) (+ bias[n]) (+ C[m, n])`, f16/bf16 in
// and out, f32 sums, with `l` the update's rank-r factor already scaled and `C` a residual (a
// gradient of the input registered before). The update is one more reduction block of the same
// product, so the `[m, n]` output is written once and the base's output is never read back. With
// Burn's `[in, out]` weight `W₀` and PEFT's `A` `[r, in]`, `B` `[out, r]`:
// - the forward `y = x · W₀ + (s · h) · Bᵀ + bias` takes W = W₀ stored `[k, n]` (KILN_W_MN 1) and
//   R = B stored `[n, r]` (KILN_R_MN 0), `h = dropout(x) · Aᵀ`;
// - the input gradient `dx = dy · W₀ᵀ + dh · A (+ prior)` takes W = W₀ᵀ, stored `[n, k]`
//   (KILN_W_MN 0), and R = Aᵀ, stored `[r, n]` (KILN_R_MN 1), `dh = s · dy · B`;
// and a weight stored transposed (a `[out, in]` buffer viewed as `[in, out]`) flips KILN_W_MN.
// The rank-r products that make `h` and `dh` stay outside: they are `[m, r]` and read one
// full-width tensor each.
//
// As an MMA it is `outᵀ = W · xᵀ`: a tile is FEATS = 128 output columns (two warpgroups of M = 64)
// by TOKS = 256 rows of x (N), the reduction in blocks of BK = 64. The cubes are persistent (one an
// SM, tiles strided by the grid) and three warpgroups each. The first copies: one thread issues
// the tensor copies of each block (x's `[256, 64]` box, W's `[128, 64]` box or, N-major, two
// `[64, 64]` boxes; 128-byte swizzle, zeros outside the tensors) into a ring of STAGES stages, each
// stage's `full` mbarrier counting the bytes in and its `empty` mbarrier the two MMA warpgroups'
// releases, running on into the next tile while the MMA warpgroups finish this one. The update's
// block comes first in each tile, from `l` and `R`'s maps: its columns past `r` are the copies'
// zeros, and only its first KILN_UPDATE_STEPS k16 steps are issued (⌈r / 16⌉). The MMA warpgroups
// round the tile (the bias added) into a 128-byte-swizzled buffer of their own, half the tile's
// rows at a time, and one thread stores each half by two tensor copies (`out_map`, clipped to
// `[m, n]`), which run on while the next tile's MMAs start. With a residual that thread first
// copies C's half into the buffer (`c_map`, onto its own mbarrier) and each thread adds the
// values it overwrites, so the sum is rounded once. (C's copy waits in the epilogue: landing C's
// whole tile during the MMAs took a buffer as large as the tile, so a stage fewer, and ran slower:
// fifty-second session.)
//
// Measured on the H200 (`benches/probes/lora_linear.py`, fifty-second session): at 4096³ the base
// product alone ran 0.99× torch's cuBLAS GEMM, and with a rank-16 update 1.01× its time, where
// torch's base product and `addmm` of the update took 1.12×. Three stages and a whole-tile output
// buffer ran 0.97×; cubes one per tile (not persistent), 0.96×; clusters of two cubes sharing x's
// block by multicast copies, 0.60×. A residual costs 0.93× (0.1907 against 0.1788 ms at 4096³;
// torch's product, `addmm` and add 0.2197).
//
// Defines: KILN_OUT_KIND (1 f16, 2 bf16), KILN_WGMMA_TYPE ("f16", "bf16"), KILN_W_MN and KILN_R_MN
// (1: W, or R, stored `[k, n]` — N contiguous, wgmma's M-major A operand; 0: `[n, k]`, K-major),
// KILN_UPDATE_STEPS (0: no update, up to 4: rank ≤ 64), KILN_RESIDUAL (0, 1). kiln places
// `hopper/common.cuh`, `hopper/wgmma.cuh` and `cuda_out.cuh` before this source.

#define FEATS 128
#define TOKS 256
#define BK 64
#define STAGES 4
// The output tile is stored in ROUNDS pieces of TOKS / ROUNDS rows through one buffer.
#define ROUNDS 2
#define GROUP 8
#define THREADS 384
#define MMA_THREADS 256
// Registers a thread after `setmaxnreg`: the MMA threads hold 128 accumulators.
#define COPY_REGS 40
#define MMA_REGS 232
#define X_TILE (TOKS * BK * 2)
#define W_TILE (FEATS * BK * 2)
#define STAGE_BYTES (X_TILE + W_TILE)
#define OUT_TILE (TOKS / ROUNDS * FEATS * 2)
// The stages, the output tile, the stages' two mbarriers each and the residual's, and 1 KB to
// align the swizzled tiles.
#define KILN_SHARED_BYTES (STAGES * STAGE_BYTES + OUT_TILE + (2 * STAGES + 1) * 8 + 1024)
#define UPDATE (KILN_UPDATE_STEPS > 0)

struct LinearParams {
    u32 m;          // rows of x and out
    u32 n;          // output columns
    u32 k;          // the base's reduction
    u32 has_bias;   // whether `bias` is read
};

static_assert(sizeof(out_t) == 2, "f16 or bf16 outputs");
static_assert(COPY_REGS * (THREADS - MMA_THREADS) + MMA_REGS * MMA_THREADS <= 65536, "the register file");
static_assert(KILN_UPDATE_STEPS <= BK / 16, "rank ≤ 64: one block");

// Output tiles of a launch.
__device__ __forceinline__ u32 tiles_of(const LinearParams& p) { return ((p.m + TOKS - 1) / TOKS) * ((p.n + FEATS - 1) / FEATS); }

__device__ __forceinline__ u32 x_at(u32 base, int s) { return base + s * STAGE_BYTES; }
__device__ __forceinline__ u32 w_at(u32 base, int s) { return base + s * STAGE_BYTES + X_TILE; }
__device__ __forceinline__ u32 out_at(u32 base) { return base + STAGES * STAGE_BYTES; }
__device__ __forceinline__ u32 full_at(u32 base, int s) { return base + STAGES * STAGE_BYTES + OUT_TILE + 8 * s; }
__device__ __forceinline__ u32 empty_at(u32 base, int s) { return base + STAGES * STAGE_BYTES + OUT_TILE + 8 * (STAGES + s); }
// The mbarrier on which the residual's half tile lands.
__device__ __forceinline__ u32 residual_at(u32 base) { return base + STAGES * STAGE_BYTES + OUT_TILE + 16 * STAGES; }

// The maps of a tile's reduction blocks: block 0 is the update's where there is one.
struct Maps {
    const TensorMap* x;
    const TensorMap* w;
    const TensorMap* l;
    const TensorMap* r;
};

// The copying thread's part: every block of the cube's tiles, block `it` (counted over the tiles)
// into stage `it % STAGES` once both MMA warpgroups have released the block STAGES before it.
__device__ __forceinline__ void copy_tiles(u32 base, const Maps& maps, const LinearParams& p, int blocks) {
    int it = 0;
    for (u32 tile = blockIdx.x; tile < tiles_of(p); tile += gridDim.x) {
        u32 tok0, f0;
        grouped_tile<TOKS, FEATS, GROUP>(tile, p.m, p.n, tok0, f0);
        for (int i = 0; i < blocks; ++i, ++it) {
            const int s = it % STAGES;
            if (it >= STAGES) barrier_wait(empty_at(base, s), (it / STAGES - 1) & 1);
            const bool update = UPDATE && i == 0;
            const TensorMap* a = update ? maps.r : maps.w;
            const u32 col = update ? 0 : (i - UPDATE) * BK, full = full_at(base, s);
            barrier_expect(full, STAGE_BYTES);
            tensor_copy(x_at(base, s), update ? maps.l : maps.x, col, tok0, full);
            if (update ? KILN_R_MN : KILN_W_MN) {
                tensor_copy(w_at(base, s), a, f0, col, full);
                tensor_copy(w_at(base, s) + W_TILE / 2, a, f0 + 64, col, full);
            } else {
                tensor_copy(w_at(base, s), a, col, f0, full);
            }
        }
    }
}

// Issues `STEPS` k16 steps of stage `s`'s block into `acc` (warpgroup `c`'s 64 output columns by
// TOKS rows) as one wgmma group, its W (or R) tile stored N-major when `MN`.
template <bool MN, int STEPS>
__device__ __forceinline__ void issue_block(float (&acc)[TOKS / 2], u32 base, int s, int c) {
    const u64 a = descriptor(w_at(base, s) + c * (W_TILE / 2), MN ? BK * 128 : 16, 1024);
    const u64 b = descriptor(x_at(base, s), 16, 1024);
    wgmma_fence();
    // A k16 step is 16 of an N-major tile's 128-byte rows, or 32 bytes along K-major rows.
    #pragma unroll
    for (int j = 0; j < STEPS; ++j) {
        if (MN)
            wgmma_ss_ma_n256(acc, a + j * (16 * 128 / 16), b + j * 2, 1);
        else
            wgmma_ss_n256(acc, a + j * 2, b + j * 2, 1);
    }
    wgmma_commit();
}

// An MMA warpgroup's part of a tile: every block's MMAs into `acc`, each stage released once its
// MMAs are retired (one block stays in flight behind the next); `it` counts blocks over the tiles.
// `signals`: this thread releases for its warpgroup.
__device__ __forceinline__ void multiply_tile(float (&acc)[TOKS / 2], u32 base, int blocks, int c, bool signals, int& it) {
    #pragma unroll
    for (int q = 0; q < TOKS / 2; ++q) acc[q] = 0.f;
    for (int i = 0; i < blocks; ++i, ++it) {
        const int s = it % STAGES;
        barrier_wait(full_at(base, s), (it / STAGES) & 1);
        if (UPDATE && i == 0)
            issue_block<KILN_R_MN, KILN_UPDATE_STEPS>(acc, base, s, c);
        else
            issue_block<KILN_W_MN, BK / 16>(acc, base, s, c);
        wgmma_wait<1>();
        if (signals && i > 0) barrier_arrive(empty_at(base, (it - 1) % STAGES));
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (signals) barrier_arrive(empty_at(base, (it - 1) % STAGES));
}

// The bias of output column `f` as f32 (zero past `n`).
__device__ __forceinline__ float bias_of(const out_t* bias, u32 f, u32 n) { return f < n ? kiln_float(bias[f]) : 0.f; }

// Named barrier 2 over the two MMA warpgroups.
__device__ __forceinline__ void mma_sync() { asm volatile("bar.sync 2, %0;" ::"n"(MMA_THREADS) : "memory"); }

// Rounds warpgroup `c`'s accumulators (the bias and residual added after the sum, as cuBLASLt's
// epilogue does) into the output buffer, ROUNDS pieces of the tile's rows each as two `[ROWS,
// 64]` boxes in the 128-byte swizzle of `out_map`'s, and has thread `storer` store them. The
// buffer is free once the previous piece's store has read it; `residuals` counts the residual's
// landings (its mbarrier's phases).
__device__ __forceinline__ void store_tile_async(const float (&acc)[TOKS / 2], u32 base, const TensorMap* out_map, const TensorMap* c_map, const out_t* bias, const LinearParams& p, u32 tok0,
                                                 u32 f0, int c, int warp, int lane, bool storer, int& residuals) {
    const u32 first = c * 64 + warp * 16 + lane / 4;
    const float b0 = p.has_bias ? bias_of(bias, f0 + first, p.n) : 0.f, b1 = p.has_bias ? bias_of(bias, f0 + first + 8, p.n) : 0.f;
    const u32 tile = out_at(base);
    constexpr int ROWS = TOKS / ROUNDS, J = ROWS / 8;
    // acc[4j + 2h + e] is row 8j + 2t + e of the tile, output column `first + 8h`.
    const auto at = [=](int row, int col) { return tile + (col / 64) * (ROWS * 128) + row * 128 + ((((col % 64) / 8) ^ (row % 8)) << 4); };
    #pragma unroll
    for (int round = 0; round < ROUNDS; ++round) {
        if (storer) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#if KILN_RESIDUAL
        if (storer) {
            barrier_expect(residual_at(base), OUT_TILE);
            #pragma unroll
            for (int half = 0; half < 2; ++half) tensor_copy(tile + half * (ROWS * 128), c_map, f0 + 64 * half, tok0 + round * ROWS, residual_at(base));
        }
        barrier_wait(residual_at(base), residuals++ & 1);
        stage_pairs_transposed_onto<J>(at, c * 64 + warp * 16, lane, [&](int j, int h, u32 old) {
            const float bh = h ? b1 : b0;
            const int q = 4 * (j + round * J) + 2 * h;
            return kiln_out2(acc[q] + bh + kiln_float(old & 0xffffu), acc[q + 1] + bh + kiln_float(old >> 16));
        });
#else
        mma_sync();
        stage_pairs_transposed_impl<J, false>(at, c * 64 + warp * 16, lane, [&](int j, int h, bool&) {
            const float bh = h ? b1 : b0;
            const int q = 4 * (j + round * J) + 2 * h;
            return kiln_out2(acc[q] + bh, acc[q + 1] + bh);
        }, [](int, int) { return 0u; });
#endif
        async_proxy_fence();
        mma_sync();
        if (storer) {
            #pragma unroll
            for (int half = 0; half < 2; ++half)
                asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(out_map), "r"(f0 + 64 * half), "r"(tok0 + round * ROWS),
                             "r"(tile + half * (ROWS * 128)) : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
}

// The six maps (x `[m, k]`; W; l `[m, r]`; R; out `[m, n]`; the residual C `[m, n]`, out's own
// without one), then their tensors (unread) and the bias (`[n]`, read when `has_bias`). A cube an SM at most, each taking tiles `blockIdx.x`,
// `+ gridDim.x`, …; THREADS threads, KILN_SHARED_BYTES of shared memory.
extern "C" __global__ void __launch_bounds__(THREADS, 1) kiln_lora_linear(
    const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map, const __grid_constant__ TensorMap l_map, const __grid_constant__ TensorMap r_map,
    const __grid_constant__ TensorMap out_map, const __grid_constant__ TensorMap c_map, const out_t* __restrict__ x, const out_t* __restrict__ w, const out_t* __restrict__ l,
    const out_t* __restrict__ r, out_t* __restrict__ out, const out_t* __restrict__ residual, const out_t* __restrict__ bias, const __grid_constant__ LinearParams p) {
    extern __shared__ unsigned char shared_raw[];
    const u32 base = (shared_address(shared_raw) + 1023) & ~1023u;
    const int blocks = UPDATE + (p.k + BK - 1) / BK;
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(full_at(base, s));
            barrier_init(empty_at(base, s), 2);
        }
        barrier_init(residual_at(base));
        barrier_init_fence();
    }
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(COPY_REGS));
        if (threadIdx.x == 0) copy_tiles(base, Maps{&x_map, &w_map, &l_map, &r_map}, p, blocks);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(MMA_REGS));
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, c = wg - 1;
    const bool storer = threadIdx.x == 128;
    int it = 0, residuals = 0;
    float acc[TOKS / 2];
    for (u32 tile = blockIdx.x; tile < tiles_of(p); tile += gridDim.x) {
        u32 tok0, f0;
        grouped_tile<TOKS, FEATS, GROUP>(tile, p.m, p.n, tok0, f0);
        multiply_tile(acc, base, blocks, c, threadIdx.x % 128 == 0, it);
        store_tile_async(acc, base, &out_map, &c_map, bias, p, tok0, f0, c, warp, lane, storer, residuals);
    }
    if (storer) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
