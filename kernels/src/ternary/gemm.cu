// W2A8 GEMM on Hopper's integer warpgroup MMA: `out[m, n] = (Σ_k c_w[n, k] · q_x[m, k] − Σ_k q_x[m, k])
// / (s_x[m] · s_w[n])`, with `c_w = w + 1` the packed 2-bit weight codes (0..2) and `q_x` the int8
// activation codes, so the wgmma multiplies unsigned codes by signed activations (`u8 × s8 → s32`)
// and the code sums turn `Σ c_w · q_x` into `Σ w · q_x` exactly. Layouts as in `mod.rs`: weight
// rows of `row_words` u32 words (16 codes each, code `i` at bit `8 · (i % 4) + 2 · (i / 4)`,
// zero weights past `k` to the 64 granule); int8 activation codes tiled (`ActCodes::Tiled`):
// `[blocks][m][128]`, zeros past `k`, each row's 16-byte chunk `c` at `c ^ (row % 8)`, so a
// tile's block of 256 rows is one contiguous run of bytes already in the 128-byte swizzle.
//
// The weight crosses memory at 2 bits a weight and is expanded into bytes in shared memory, one
// packed word into one 16-byte chunk (the packing puts elements `4j … 4j+3` of a word at bytes
// 0..3 of `word >> 2j`, so a chunk is four shifts and masks), in the same swizzled layout as the
// activations, and both MMA operands come from shared memory. Taking A from registers instead
// (each thread unpacking its `m16n8k32` fragment) made ptxas serialize the wgmmas, since registers
// feeding the next block's MMAs were written while the previous block's were in flight
// (`benches/RESULTS.md`, thirty-third session).
//
// Work of one cube: FEATS = 128 weight rows by TOKS = 256 activation rows, k in blocks of 128
// codes, and three warpgroups. The first makes the operands: one thread copies each block's
// activations (one bulk copy, `cp.async.bulk`, onto the stage's mbarrier, through a ring of
// STAGES stages two blocks ahead), and each thread copies one weight row's 32 packed bytes
// (`cp.async`, through a ring W_LEAD blocks ahead) and expands that row into its MMA warpgroup's
// byte tile. The other two (64 weight rows each) only run the MMAs. Step kb: one cube barrier
// (named barrier 1, reached from each role's own loop: a branch on the role inside one loop makes
// ptxas serialize the wgmmas) publishes block kb's bytes and retires block kb − 2's MMAs; the MMA
// warpgroups wait for the activations, issue the block's four k32 MMAs and retire block kb − 1's,
// while the first warpgroup refills the rings and expands block kb + 1 into the third of the VALS
// byte tiles. Against two warpgroups that each copied and expanded their own rows between their
// MMAs (and `__syncthreads` a block) this made the kernel 12–18% faster, up to 1409 TOP/s, 71%
// of the int8 peak (thirty-seventh session). Cubes walk the tiles in groups of GROUP activation
// tiles, so a group's activations stay in L2 while its weights stream past once.
//
// Launches of more tiles than SMs take the stream-K schedule (`hopper/common.cuh`): one cube an SM,
// whole tiles for the whole waves, then an equal share of the last tiles' blocks; a tile's helpers
// leave their integer sums in global slots, which its owner adds before its epilogue. Launches of
// fewer tiles than half the SMs split each tile's k over a cluster of SPLITS = 2 or 3 cubes instead
// (`hopper::cluster_splits`), the others' sums added through distributed shared memory
// (`gather_splits`): cheaper than the global slots where every tile is shared alike. Integer sums
// make both splits exact. A cube reuses its stages and byte tiles from part to part, the
// activations' mbarriers counted on across them (`ring`: the blocks the cube has run).
//
// Defines: KILN_OUT_KIND (0 f32, 1 f16, 2 bf16), KILN_SPLITS (1, 2, 3). kiln places `hopper/common.cuh`,
// `hopper/wgmma_int.cuh` and `cuda_out.cuh` (the output element) before this source.

#define FEATS 128
#define TOKS 256
#define BK 128
#define STAGES 4
#define W_STAGES 8
#define W_LEAD 6
#define VALS 3
#define GROUP 8
#define THREADS 384
#define SPLITS KILN_SPLITS
#define MAKERS 128
#define MMA_THREADS 256
// Registers a thread after the warpgroups' `setmaxnreg`: the MMA threads hold 128 accumulators
// across the part loop. Without it ptxas kept every thread at 168 and spilled; with it the GEMM
// ran 1–4% faster (fifty-fifth session).
#define MAKER_REGS 56
#define MMA_REGS 224
#define ACT_TILE (TOKS * BK)
#define W_TILE (FEATS * BK / 4)
// An MMA warpgroup's weight rows of one block as bytes (its A operand); a slot holds both.
#define CODE_TILE (64 * BK)
// Output tile rows in shared memory are padded by 16 bytes so that a warp's stores spread over banks.
#define OUT_PITCH (FEATS + 16 / (int)sizeof(out_t))

// Bytes of dynamic shared memory the launch requests: the activation stages, the weight's ring,
// the byte tiles, the tile's scales, their reciprocals and the code sums (`Scales`), the stages'
// mbarriers, and 1 KB more to align the swizzled tiles.
#define SCALES_BYTES ((3 * TOKS + 2 * FEATS) * 4)
#define KILN_SHARED_BYTES (STAGES * ACT_TILE + W_STAGES * W_TILE + VALS * 2 * CODE_TILE + SCALES_BYTES + STAGES * 8 + 1024)

static_assert(TOKS * OUT_PITCH * sizeof(out_t) <= STAGES * ACT_TILE + W_STAGES * W_TILE, "the output tile fits in the stages and the weight's ring");

struct GemmParams {
    u32 m;          // activation rows
    u32 n;          // weight rows (output features)
    u32 row_words;  // packed words per weight row (k padded to 64, over 16)
    u32 group;      // weight rows per scale
};

// `a / d` rounded once to f32, as IEEE division rounds it, for |a| < 2^24 and a finite positive
// `d` (a product of two positive scales), without branches: the f32 division is a subroutine
// with a slow path, and 128 of them a thread, each a scheduling barrier, made a tile of four k
// blocks take 26 µs (10 µs with a multiply in their place, 17 µs with this function). In
// f64 the quotient comes within about 2^-52 of `a / d` (an approximate reciprocal, two Newton
// steps, one correction of the quotient), and rounding that to f32 is exact: with a 24-bit `a`
// and a 24-bit `d`, `a / d` is never a midpoint between floats and never within 2^-49 (relative)
// of one, so the f64 error cannot move the rounding. Scales of rows holding inf or NaN give NaN
// here where the division gives inf or 0.
__device__ __forceinline__ float quotient(int a, float d) {
    const double dd = d, aa = a;
    double r;
    asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(dd));
    r = fma(fma(-dd, r, 1.0), r, r);
    r = fma(fma(-dd, r, 1.0), r, r);
    const double q = aa * r;
    return (float)fma(fma(-dd, q, aa), r, q);
}

#if KILN_OUT_KIND != 0
// `a / (sx · sw)` as the f32 division rounds it, then rounded to the 16-bit out_t, from
// `p = rx · rw`, the product of the scales' reciprocals (each rounded once), where that settles
// it: `a · p` lies within 6 f32 steps of the quotient (five roundings of relative error 2^-24
// each, the scale product's in the quotient included, and the quotient's own half step), so
// where the f32 values 8 steps either side of it round to the same out_t, so does the quotient
// (rounding is monotonic). Two multiplies and one paired conversion, where `quotient` takes f64
// conversions and a reciprocal on the slow units. bf16 keeps an f32's high 16 bits, rounded to
// nearest even, so there the test is on the low 16 bits alone: the 17 values lie on one side of
// the tie 0x8000 unless those bits are within 8 of it (one subtraction and compare in place of
// a second conversion: 0.6% of a tile, thirty-eighth session). Returns false (the caller divides)
// where an out_t rounding boundary is within reach, `p` is below the normal range, or values are
// not finite or near the top of the range: with random data about one element in 4000 (bf16) or
// 500 (f16). f32 outputs divide.
__device__ __forceinline__ bool scaled_fast(int a, float p, u32& out) {
    const float f = (float)a * p;
    const u32 bits = __float_as_uint(f);
#if KILN_OUT_KIND == 2
    out = kiln_out(f);
    return (p >= 1.17549435e-38f) & ((bits & 0xffffu) - 0x7ff8u > 16u) & ((bits & 0x7fffffffu) < 0x7f7f0000u);
#else
    // the out_t of the f32 8 steps below (low half) and above (high half)
    const u32 ends = kiln_out2(__uint_as_float(bits - 8), __uint_as_float(bits + 8));
    out = ends & 0xffffu;
    return (p >= 1.17549435e-38f) & ((ends >> 16) == out);
#endif
}
#endif

// The tile's activation scales and code sums and its weight rows' scales, with the scales'
// reciprocals for 16-bit outputs (`scaled_fast`), read from global memory while the main loop
// runs: the epilogue then waits on shared memory, not on 192 global loads a thread behind its
// divisions (2048 × 28672 × 8192: 0.96 → 0.92 ms).
struct Scales {
    float x[TOKS];
    int sum[TOKS];
    float w[FEATS];
    float rx[TOKS];
    float rw[FEATS];
};

__device__ __forceinline__ void load_scales(Scales* s, const float* x_scales, const float* x_sums, const float* w_scales, const GemmParams& p, u32 tok0, u32 f0, u32 i) {
    static_assert(TOKS == MMA_THREADS && FEATS <= MMA_THREADS, "one token an MMA thread");
    const u32 tok = tok0 + i, f = f0 + i;
    s->x[i] = tok < p.m ? x_scales[tok] : 1.f;
    s->sum[i] = tok < p.m ? (int)x_sums[tok] : 0;
    if (i < FEATS) s->w[i] = f < p.n ? w_scales[f / p.group] : 1.f;
#if KILN_OUT_KIND != 0  // (f32 outputs divide)
    s->rx[i] = __frcp_rn(s->x[i]);
    if (i < FEATS) s->rw[i] = __frcp_rn(s->w[i]);
#endif
}

// Where the cube's `ring`-th activation block lands: stage `ring % STAGES`.
__device__ __forceinline__ u32 stage_at(u32 base, u32 ring) { return base + (ring % STAGES) * ACT_TILE; }

// Where block `kb`'s packed weight rows land: slot `kb % W_STAGES` of the weight's ring, right after
// the stages (so that an f32 output tile can span both).
__device__ __forceinline__ u32 weights_at(u32 base, int kb) { return base + STAGES * ACT_TILE + (kb % W_STAGES) * W_TILE; }

// The byte tiles of block `kb`: slot `kb % VALS`, after the weight's ring; MMA warpgroup `c`'s rows
// at `+ c · CODE_TILE`.
__device__ __forceinline__ u32 codes_at(u32 base, int kb) { return base + STAGES * ACT_TILE + W_STAGES * W_TILE + (kb % VALS) * 2 * CODE_TILE; }

// The tile's scales (`Scales`), after the byte tiles.
__device__ __forceinline__ u32 scales_at(u32 base) { return base + STAGES * ACT_TILE + W_STAGES * W_TILE + VALS * 2 * CODE_TILE; }

// The mbarrier on which stage `s`'s activation copy lands, after the scales.
__device__ __forceinline__ u32 landed_at(u32 base, int s) { return scales_at(base) + SCALES_BYTES + 8 * s; }

// Stages the activations of block `kb` of k as the cube's `ring`-th: TOKS rows of BK bytes, one
// bulk copy (rows past `m` are not copied: whatever the stage held there only reaches outputs
// that are never stored).
__device__ __forceinline__ void load_acts(u32 base, const unsigned char* acts, const GemmParams& p, u32 tok0, int kb, u32 ring) {
    const u32 bytes = min((u32)TOKS, p.m - tok0) * BK, landed = landed_at(base, ring % STAGES);
    barrier_expect(landed, bytes);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(stage_at(base, ring)), "l"(acts + ((u64)kb * p.m + tok0) * BK),
                 "r"(bytes), "r"(landed) : "memory");
}

// Stages making thread `t`'s weight row of block `kb`: BK / 4 packed bytes (two 16-byte
// `cp.async`), zeros past `n` or the padded row. The same thread expands it, so its own `cp.async`
// wait suffices.
__device__ __forceinline__ void load_weights(u32 base, const unsigned char* w, const GemmParams& p, u32 f0, int kb0, int kb, u32 t) {
    static_assert(FEATS == MAKERS && BK / 4 == 32, "one 32-byte weight row a making thread");
    const u32 slot = weights_at(base, kb) + t * 32, w_row = p.row_words * 4, off = (kb0 + kb) * (BK / 4);
    const bool ok = f0 + t < p.n && off < w_row;
    const unsigned char* src = ok ? w + (u64)(f0 + t) * w_row + off : w;
    copy16(slot, src, ok ? 16 : 0);
    copy16(slot + 16, src + 16, ok ? 16 : 0);
}

// Expands making thread `t`'s weight row of staged block `kb` into its MMA warpgroup's byte tile
// (swizzled like the activations): two 16-byte loads and eight 16-byte stores, one packed word
// into one 16-byte chunk (the packing puts elements `4j … 4j+3` of a word at bytes 0..3 of
// `word >> 2j`, so a chunk is four shifts and masks).
__device__ __forceinline__ void expand(u32 base, int kb, u32 t) {
    const u32 r = t % 64, codes = codes_at(base, kb) + (t / 64) * CODE_TILE + r * 128, src = weights_at(base, kb) + t * 32;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        u32 word[4];
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(word[0]), "=r"(word[1]), "=r"(word[2]), "=r"(word[3]) : "r"(src + h * 16));
        #pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 w = word[q], c = 4 * h + q, m = 0x03030303u;
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(codes + ((c ^ (r % 8)) << 4)), "r"(w & m), "r"((w >> 2) & m), "r"((w >> 4) & m), "r"((w >> 6) & m));
        }
    }
}

#if KILN_OUT_KIND != 0
// Stages a thread's sums, scaled, into the output tile `[TOKS][OUT_PITCH]` (`tile`, a shared
// address) by `stage_pairs_transposed_checked`: tokens `8j + 2t` and `+1` of weight row `row + 8h`
// make a packed pair, each token's scale and code sum read once for both rows. Against
// `stage_transposed` (a 2-byte store and the token's scale and sum read again for each element)
// this made the GEMM 8–19% faster (`benches/RESULTS.md`, thirty-sixth session). Where an element
// of a store's four pairs is one `scaled_fast` cannot settle, the warp divides all of them: a
// branch to the division at each pair, taken by single threads, kept ptxas from overlapping the
// pairs' steps and cost 4% of the GEMM at 8192 × 11008 × 4096 (thirty-eighth session).
__device__ __forceinline__ void stage_scaled(const int (&acc)[128], u32 tile, const Scales* scales, int c, int warp, int lane) {
    const int t = lane % 4, row = c * 64 + warp * 16 + lane / 4;  // c: the MMA warpgroup
    const float rw[2] = {scales->rw[row], scales->rw[row + 8]};
    auto sums = [&](int j, int h, int e) { return acc[4 * j + 2 * h + e] - scales->sum[8 * j + 2 * t + e]; };
    stage_pairs_transposed_checked<TOKS / 8>(tile, OUT_PITCH, c * 64 + warp * 16, lane, [&](int j, int h, bool& bad) {
        const int tok = 8 * j + 2 * t;
        u32 lo, hi;
        bad |= !(scaled_fast(sums(j, h, 0), scales->rx[tok] * rw[h], lo) & scaled_fast(sums(j, h, 1), scales->rx[tok + 1] * rw[h], hi));
        return lo | (hi << 16);
    }, [&](int j, int h) {
        const int tok = 8 * j + 2 * t;
        const float sw = scales->w[row + 8 * h];
        return (u32)kiln_out(quotient(sums(j, h, 0), scales->x[tok] * sw)) | ((u32)kiln_out(quotient(sums(j, h, 1), scales->x[tok + 1] * sw)) << 16);
    });
}
#endif

// The first warpgroup's part of one segment: blocks `[kb0, kb0 + blocks)` of the tile at `(tok0,
// f0)`, the cube's `ring`-th block onwards. Thread 0 stages the activations two blocks ahead;
// each thread copies its weight row W_LEAD blocks ahead and expands the next block's.
__device__ __forceinline__ void make_operands(u32 base, const unsigned char* acts, const unsigned char* w, const GemmParams& p, u32 tok0, u32 f0, int kb0, int blocks, u32 ring, u32 t) {
    #pragma unroll
    for (int kb = 0; kb < STAGES - 2; ++kb)
        if (t == 0 && kb < blocks) load_acts(base, acts, p, tok0, kb0 + kb, ring + kb);
    #pragma unroll
    for (int kb = 0; kb < W_LEAD; ++kb) {
        if (kb < blocks) load_weights(base, w, p, f0, kb0, kb, t);
        copy_commit();
    }
    copy_wait<W_LEAD - 1>();
    expand(base, 0, t);
    for (int kb = 0; kb < blocks; ++kb) {
        async_proxy_fence();  // the expanded bytes, before the barrier shows them to wgmma
        role_sync<THREADS>();
        if (t == 0 && kb + STAGES - 2 < blocks) load_acts(base, acts, p, tok0, kb0 + kb + STAGES - 2, ring + kb + STAGES - 2);
        if (kb + W_LEAD < blocks) load_weights(base, w, p, f0, kb0, kb + W_LEAD, t);
        copy_commit();
        copy_wait<W_LEAD - 1>();
        if (kb + 1 < blocks) expand(base, kb + 1, t);
    }
    copy_wait<0>();
}

// An MMA warpgroup's part of one segment: `blocks` blocks into `acc` (its 64 weight rows by TOKS
// tokens), the cube's `ring`-th block onwards.
__device__ __forceinline__ void multiply_blocks(int (&acc)[128], u32 base, int blocks, u32 ring, int c) {
    #pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0;
    for (int kb = 0; kb < blocks; ++kb) {
        role_sync<THREADS>();
        barrier_wait(landed_at(base, (ring + kb) % STAGES), ((ring + kb) / STAGES) & 1);
        const u32 stage = stage_at(base, ring + kb), a = codes_at(base, kb) + c * CODE_TILE;
        wgmma_fence();
        #pragma unroll
        for (int s = 0; s < BK / 32; ++s) wgmma_ss_u8s8_n256(acc, descriptor(a + s * 32, 16, 1024), descriptor(stage + s * 32, 16, 1024));
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
}

// Calls `f(part)` for each of the cube's parts of the launch, from one call site (see
// `for_each_segment`): with SPLITS > 1 its share of one tile's blocks (the cluster's first cube
// finishes the tile), else its stream-K segments (one whole tile where the launch has a cube a
// tile).
template <typename F>
__device__ __forceinline__ void for_each_part(const StreamK& work, u32 ticket, F f) {
#if SPLITS > 1
    const int rank = blockIdx.x % SPLITS, kb0 = work.blocks * rank / SPLITS;
    f(Segment{blockIdx.x / SPLITS, kb0, (int)(work.blocks * (rank + 1) / SPLITS) - kb0, 0});
#else
    for_each_segment(work, ticket, f);
#endif
}

// acts tiled int8 codes (`[blocks][m][128]`, above); x_scales, x_sums `[m]` f32 (the sums are integers);
// w `[n, row_words]` packed words; w_scales one f32 per `group` rows; out dense `[m, n]`; sync the
// stream-K counter and flags (`StreamK`: zero, 4 bytes more than 4 a cube); slots the helpers'
// sums (128 KB a cube; unread where cubes take whole tiles). THREADS threads, KILN_SHARED_BYTES of
// shared memory; SPLITS cubes a tile (a cluster) where SPLITS > 1.
extern "C" __global__ void KILN_CLUSTER __launch_bounds__(THREADS, 1) kiln_ternary_gemm(
    const unsigned char* __restrict__ acts, const float* __restrict__ x_scales, const float* __restrict__ x_sums,
    const unsigned char* __restrict__ w, const float* __restrict__ w_scales, out_t* __restrict__ out,
    u32* __restrict__ sync, u32* __restrict__ slots, const __grid_constant__ GemmParams p) {
    extern __shared__ unsigned char shared_raw[];
    const u32 base = (shared_address(shared_raw) + 1023) & ~1023u;
    const StreamK work{((p.m + TOKS - 1) / TOKS) * ((p.n + FEATS - 1) / FEATS), (p.row_words * 16 + BK - 1) / BK};
    // The warpgroup, taken from lane 0 so that the compiler sees it uniform across a warp.
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) barrier_init(landed_at(base, s));
        barrier_init_fence();
    }
#if SPLITS > 1
    __syncthreads();
    const u32 ticket = 0;  // (unused: no stream-K slots)
    const int rank = blockIdx.x % SPLITS;
#else
    __shared__ u32 ticket_slot;
    const u32 ticket = take_ticket(sync, &ticket_slot, work.tiles);  // (its barrier also publishes the mbarriers)
#endif
    Scales* scales = reinterpret_cast<Scales*>(shared_raw + (scales_at(base) - shared_address(shared_raw)));
    out_t* tile = reinterpret_cast<out_t*>(shared_raw + (base - shared_address(shared_raw)));
    // Blocks the cube has run: where the activations' stages and mbarriers stand (unsigned, so that
    // a stage and a parity are a mask and a shift).
    u32 ring = 0;
    // A part that finishes its tile ends on three cube barriers: the stages are free (the MMAs are
    // done), the output tile is staged in them, and it is written out (the next part's copies may
    // overwrite it). A part that leaves its sums to another cube ends on the first.
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(MAKER_REGS));
        for_each_part(work, ticket, [&](const Segment& s) {
            u32 tok0, f0;
            grouped_tile<TOKS, FEATS, GROUP>(s.tile, p.m, p.n, tok0, f0);
            make_operands(base, acts, w, p, tok0, f0, s.kb0, s.blocks, ring, threadIdx.x);
            ring += s.blocks;
            role_sync<THREADS>();
#if SPLITS > 1
            if (gather_splits_idle(rank)) return;
#else
            if (s.helps()) return;
#endif
            role_sync<THREADS>();
            store_tile<TOKS, FEATS, THREADS>(out, tile, OUT_PITCH, p.m, p.n, tok0, f0);
            role_sync<THREADS>();
        });
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(MMA_REGS));
        const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, c = wg - 1;
        const u32 t = threadIdx.x - MAKERS;
        for_each_part(work, ticket, [&](const Segment& s) {
            u32 tok0, f0;
            grouped_tile<TOKS, FEATS, GROUP>(s.tile, p.m, p.n, tok0, f0);
            if (!s.helps()) load_scales(scales, x_scales, x_sums, w_scales, p, tok0, f0, t);
            int acc[128];
            multiply_blocks(acc, base, s.blocks, ring, c);
            ring += s.blocks;
            role_sync<THREADS>();
#if SPLITS > 1
            static_assert(128 * MMA_THREADS * 4 <= STAGES * ACT_TILE + W_STAGES * W_TILE, "the sums fit in the stages");
            if (gather_splits<MMA_THREADS>(acc, base, rank, SPLITS, t)) return;
#else
            if (s.helps()) {
                publish_sums<MMA_THREADS>(acc, slots, sync, ticket, t);
                return;
            }
            gather_sums<MMA_THREADS>(acc, slots, sync, ticket, s.helpers, t);
#endif
            // Scale into the output tile `[TOKS][OUT_PITCH]` in shared memory: acc[4j + 2h + e] is
            // token 8j + 2t + e, weight row `row + 8h`.
#if KILN_OUT_KIND == 0
            const int row = c * 64 + warp * 16 + lane / 4;  // this thread's first weight row in the tile; the second is + 8
            stage_transposed<TOKS / 8>(tile, OUT_PITCH, row, lane % 4, [&](int i, int tok, int h) {
                return quotient(acc[i] - scales->sum[tok], scales->x[tok] * scales->w[row + 8 * h]);
            });
#else
            stage_scaled(acc, shared_address(tile), scales, c, warp, lane);
#endif
            role_sync<THREADS>();
            store_tile<TOKS, FEATS, THREADS>(out, tile, OUT_PITCH, p.m, p.n, tok0, f0);
            role_sync<THREADS>();
        });
    }
}
