// All-pairs similarity of packed trit vectors on the binary tensor cores (`mma.sync` on .b1
// operands with AND + popcount, sm_80 and up), which CubeCL's IR has no instruction for.
//
// Layout (`kiln::ops::trit::format`): a vector is `pairs` word pairs [plus_w, minus_w], 32 trits a
// pair, bits past the length zero. One k-slab is 256 trits: the planes' words 8s … 8s + 7.
//
// Stored vectors are the A operand (16 a tile), queries the B operand (8 a tile). Lane (g, t) =
// (lane / 4, lane % 4) holds words t and t + 4 of the slab:
//   a0 = vector g, word t;  a1 = vector g + 8, word t;  a2 = vector g, word t + 4;  a3 = vector g + 8, word t + 4
//   b0 = query g, word t;   b1 = query g, word t + 4
//   d0, d1 = vector g × queries 2t, 2t + 1;  d2, d3 = vector g + 8 × the same queries
// so one 8-byte load brings a vector word's plus and minus plane, and the rows of memory are read
// front to back once. The AND-popcount sums over k, so only A and B's k must match (they do).
//
// Scores from AND-popcounts alone (x stored, q query; p, n the planes, z = neither):
//   dot     = popc(xp & qp) + popc(xn & qn) + popc(~xn & qp) + popc(~xp & qn) − nnz(q)
//             (a nonzero q trit counts 2 where x agrees, 1 where x = 0, 0 where x disagrees)
//   hamming = 256 · slabs − [popc(xp & qp) + popc(xn & qn) + popc(xz & qz)]
//             (equal trits; every bit past the length, up to the last slab's end, is a zero in
//             both and counts as equal in every pair, so no length is needed)
// Complements of the stored words are ones past `pairs` (loaded as zero), where the staged query
// words are zero (dot).
//
// Compile-time parameters (`#define`d before this text): KILN_NT query tiles of 8 per cube,
// KILN_MT vector tiles of 16 per warp, KILN_WARPS warps per cube, KILN_KC slabs of queries staged
// in shared memory at a time (a multiple of KILN_DEPTH), KILN_DEPTH slabs of stored words loaded
// ahead, KILN_HAMMING 0 (dot) or 1.

#define KILN_CUBE (KILN_WARPS * 32)

struct Params {
    unsigned query_rows;
    unsigned memory_rows;
    unsigned pairs;  // word pairs per vector
};

__device__ __forceinline__ void kiln_bmma(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    // Not volatile: the product has no side effect, and the compiler may interleave independent ones.
    asm("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Stored words of `slab` for this lane: per vector tile, (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4).
__device__ __forceinline__ void kiln_load_slab(uint2 (&dst)[KILN_MT][4], const uint2* __restrict__ memory, unsigned vbase,
                                               unsigned slab, unsigned g, unsigned t, const Params& p) {
#pragma unroll
    for (int m = 0; m < KILN_MT; ++m) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const unsigned v = vbase + m * 16 + g + (r & 1) * 8;
            const unsigned w = slab * 8 + t + (r >> 1) * 4;
            dst[m][r] = (v < p.memory_rows && w < p.pairs) ? __ldg(memory + (size_t)v * p.pairs + w) : make_uint2(0, 0);
        }
    }
}

// Queries in fragment order, once per launch (`kiln_trit_prepare_queries`): entry
// ((group · slabs + slab) · KILN_NT + tile) · 32 + lane holds, for query g of the tile, the plus
// words t and t + 4 of the slab, then the minus words; zeros past the rows and `pairs`. A cube then
// stages a chunk of slabs with one contiguous asynchronous copy. `nnz` gets each query's nonzero
// count (dot's correction).
extern "C" __global__ void __launch_bounds__(128) kiln_trit_prepare_queries(
    const uint2* __restrict__ queries, unsigned* __restrict__ staged, int* __restrict__ nnz, const __grid_constant__ Params p) {
    __shared__ int partial[4];
    const unsigned q = blockIdx.x;  // a query slot: 8 · KILN_NT of them per group
    const unsigned group = q / (KILN_NT * 8), tile = q % (KILN_NT * 8) / 8, g = q % 8;
    const unsigned slabs = (p.pairs + 7) / 8;
    int count = 0;
    for (unsigned w = threadIdx.x; w < slabs * 8; w += blockDim.x) {
        const uint2 x = q < p.query_rows && w < p.pairs ? __ldg(queries + (size_t)q * p.pairs + w) : make_uint2(0, 0);
        const unsigned half = w % 8 / 4;
        const size_t e = ((size_t)(group * slabs + w / 8) * KILN_NT + tile) * 32 + g * 4 + w % 4;
        staged[e * 4 + half] = x.x;
        staged[e * 4 + 2 + half] = x.y;
        count += __popc(x.x) + __popc(x.y);
    }
    for (int o = 16; o > 0; o /= 2) count += __shfl_xor_sync(0xffffffffu, count, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = count;
    __syncthreads();
    if (threadIdx.x == 0 && q < p.query_rows) nnz[q] = partial[0] + partial[1] + partial[2] + partial[3];
}

// `n` staged entries from `src` into shared `dst`, asynchronously, as one commit group.
__device__ __forceinline__ void kiln_copy_entries(uint4* dst, const uint4* src, unsigned n) {
    for (unsigned i = threadIdx.x; i < n; i += KILN_CUBE) {
        const unsigned to = (unsigned)__cvta_generic_to_shared(dst + i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(src + i));
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

// One term for every pair of tiles: acc[m][j] += popc(a[m] & b[j]) over the slab, as a batch of
// independent accumulators, so consecutive MMAs never wait on each other's result.
__device__ __forceinline__ void kiln_term(int (&acc)[KILN_MT][KILN_NT][4], const unsigned (&a)[KILN_MT][4], const unsigned (&b0)[KILN_NT],
                                          const unsigned (&b1)[KILN_NT]) {
#pragma unroll
    for (int j = 0; j < KILN_NT; ++j)
#pragma unroll
        for (int m = 0; m < KILN_MT; ++m) kiln_bmma(acc[m][j], a[m], b0[j], b1[j]);
}

// The products of one slab: every vector tile of the warp against every staged query tile, one
// term at a time (the score formulas at the top).
__device__ __forceinline__ void kiln_slab(int (&acc)[KILN_MT][KILN_NT][4], const uint2 (&x)[KILN_MT][4], const uint4* stage,
                                          unsigned s, unsigned lane) {
    unsigned qp0[KILN_NT], qp1[KILN_NT], qn0[KILN_NT], qn1[KILN_NT];
#pragma unroll
    for (int j = 0; j < KILN_NT; ++j) {
        const uint4 b = stage[(s * KILN_NT + j) * 32 + lane];
        qp0[j] = b.x, qp1[j] = b.y, qn0[j] = b.z, qn1[j] = b.w;
    }
    unsigned xp[KILN_MT][4], xn[KILN_MT][4];
#pragma unroll
    for (int m = 0; m < KILN_MT; ++m)
#pragma unroll
        for (int r = 0; r < 4; ++r) xp[m][r] = x[m][r].x, xn[m][r] = x[m][r].y;
    kiln_term(acc, xp, qp0, qp1);
    kiln_term(acc, xn, qn0, qn1);
#if KILN_HAMMING
    unsigned xz[KILN_MT][4], qz0[KILN_NT], qz1[KILN_NT];
#pragma unroll
    for (int m = 0; m < KILN_MT; ++m)
#pragma unroll
        for (int r = 0; r < 4; ++r) xz[m][r] = ~(xp[m][r] | xn[m][r]);
#pragma unroll
    for (int j = 0; j < KILN_NT; ++j) qz0[j] = ~(qp0[j] | qn0[j]), qz1[j] = ~(qp1[j] | qn1[j]);
    kiln_term(acc, xz, qz0, qz1);
#else
#pragma unroll
    for (int m = 0; m < KILN_MT; ++m)
#pragma unroll
        for (int r = 0; r < 4; ++r) xp[m][r] = ~xp[m][r], xn[m][r] = ~xn[m][r];
    kiln_term(acc, xn, qp0, qp1);  // ~xn & qp
    kiln_term(acc, xp, qn0, qn1);  // ~xp & qn
#endif
}

// scores[q][v] for query rows q0 … q0 + 8·KILN_NT − 1 (q0 = 8·KILN_NT · blockIdx.y) and the cube's
// KILN_WARPS · KILN_MT · 16 stored vectors, from the prepared queries. Chunks of KILN_KC slabs of
// them are double-buffered in shared memory: the next one is copied while this one's products run.
extern "C" __global__ void __launch_bounds__(KILN_CUBE) kiln_trit_scores_mma(
    const uint4* __restrict__ staged, const int* __restrict__ nnz, const uint2* __restrict__ memory, int* __restrict__ scores,
    const __grid_constant__ Params p) {
    extern __shared__ uint4 kiln_stage_words[];  // [2][KILN_KC][KILN_NT][32]
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned g = lane / 4, t = lane % 4;
    const unsigned vbase = (blockIdx.x * KILN_WARPS + warp) * (KILN_MT * 16);
    const unsigned q0 = blockIdx.y * (KILN_NT * 8);
    const unsigned slabs = (p.pairs + 7) / 8, chunks = (slabs + KILN_KC - 1) / KILN_KC;
    const unsigned per_slab = KILN_NT * 32;
    const uint4* group = staged + (size_t)blockIdx.y * slabs * per_slab;

    int acc[KILN_MT][KILN_NT][4];
#pragma unroll
    for (int m = 0; m < KILN_MT; ++m)
#pragma unroll
        for (int j = 0; j < KILN_NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][j][i] = 0;

    // The stored words of the next KILN_DEPTH slabs are in flight while a slab's products run: one
    // register buffer per slab, the loop unrolled by KILN_DEPTH so each is named statically.
    uint2 x[KILN_DEPTH][KILN_MT][4];
#pragma unroll
    for (int d = 0; d < KILN_DEPTH; ++d) kiln_load_slab(x[d], memory, vbase, d, g, t, p);
    kiln_copy_entries(kiln_stage_words, group, min((unsigned)KILN_KC, slabs) * per_slab);
    for (unsigned c = 0; c < chunks; ++c) {
        const unsigned first = c * KILN_KC, count = min((unsigned)KILN_KC, slabs - first);
        const uint4* stage = kiln_stage_words + (c % 2) * KILN_KC * per_slab;
        if (c + 1 < chunks) {
            const unsigned next = first + KILN_KC;
            kiln_copy_entries(kiln_stage_words + ((c + 1) % 2) * KILN_KC * per_slab, group + (size_t)next * per_slab,
                              min((unsigned)KILN_KC, slabs - next) * per_slab);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();  // chunk c is in shared memory for every thread
        for (unsigned s = 0; s < count; s += KILN_DEPTH) {
#pragma unroll
            for (int d = 0; d < KILN_DEPTH; ++d) {
                if (s + d < count) kiln_slab(acc, x[d], stage, s + d, lane);
                kiln_load_slab(x[d], memory, vbase, first + s + d + KILN_DEPTH, g, t, p);  // zeros past the last slab
            }
        }
        __syncthreads();  // chunk c's buffer may be refilled
    }

#pragma unroll
    for (int m = 0; m < KILN_MT; ++m) {
#pragma unroll
        for (int j = 0; j < KILN_NT; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned v = vbase + m * 16 + g + (i >> 1) * 8;
                const unsigned q = q0 + j * 8 + t * 2 + (i & 1);
                if (q < p.query_rows && v < p.memory_rows) {
                    // In unsigned arithmetic: a sum past 2^31 wraps, and the score itself fits.
#if KILN_HAMMING
                    const unsigned score = 256u * slabs - (unsigned)acc[m][j][i];
#else
                    const unsigned score = (unsigned)acc[m][j][i] - (unsigned)nnz[q];
#endif
                    scores[(size_t)q * p.memory_rows + v] = (int)score;
                }
            }
        }
    }
}
