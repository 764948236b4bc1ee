// The 4-bit GEMV on the tensor cores: `out[r, f] = Σ_k x[r, k] · code[q(f, k)] · scale(f, k)`
// for up to 8 half-precision activation rows, with `mma.sync.m16n8k16` doing the multiply-adds
// (f32 accumulation), so a weight costs a table lookup per pair and no float math of its own.
//
// Layout (`mod.rs`): bitsandbytes' bytes, two codes a byte, the even element in the high nibble;
// one scale per block of `block` elements of a row (`k` a multiple of `block`, `block` a
// power-of-two multiple of 64).
//
// A warp owns 16 output features (the MMA's M) and a share of `k` in spans of 64 (one span is
// in one scale block). In a span, lane (g = lane / 4, t = lane % 4) reads 8 bytes of feature g
// and 8 of feature g + 8: elements 16t … 16t + 15 of the span. Step j (four MMA steps of 16 a
// span) gives the lane's bytes 2j and 2j + 1 to the A fragment, so the MMA's logical column
// pairs (2t, 2t + 1) and (2t + 8, 2t + 9) stand for the span's elements 16t + 4j … 16t + 4j + 3;
// the B fragment (activation row g, for g < rows) takes the same elements of `x`. The product
// only needs the same permutation of `k` on both sides.
//
// A byte becomes its two weights as one table lookup: 256 entries of two half-precision codes
// (low half: the high nibble's), one copy per lane (32 KB), so a warp's lookups hit 32 banks.
// Entry e of lane l sits at byte 128·e + 4·l, so a lookup is three instructions: PRMT takes the
// byte out, LEA scales it onto the lane's 32-bit shared address, LDS reads it. Shared memory is
// addressed with 32-bit `ld.shared` throughout: through generic pointers the compiler rebuilt
// the window's base (the CTA's cluster rank) and added it at every access.
//
// Each span's products go to a fresh accumulator that is scaled into the running sum, so the
// block scale is applied in f32 per block, as the portable kernel does.
//
// Warps of a cube split `k` for one tile of 16 features and add their sums through shared
// memory; cubes stride over tiles (the table is filled once per cube). The weight bytes reach a
// warp through its own ring of KILN_STAGES slots in shared memory, each a group of KILN_UNROLL
// spans of the tile's 16 rows, copied with `cp.async` KILN_STAGES − 1 groups ahead of the one
// being multiplied (across tiles too), so HBM always has that much of every warp's reads in
// flight. The scales travel one group ahead too, in registers: a double-quantized scale is two
// dependent loads, and waiting on them at each group's start held the previous version at 50%
// of HBM. The nested code book is the cube's copy in shared memory and the offset a register,
// which took 2–4% off the kernel's time on the H200, where it is bound by its instructions and
// shared-memory traffic rather than by HBM (`benches/RESULTS.md`, forty-seventh session). The
// copy and scale cursors step through (tile, group) by additions; the divisions by runtime
// values they replace were a third of a group's instructions. A whole group's spans
// run without branches between them, so their MMA chains interleave. A warp's groups of a tile
// are one contiguous range of `k` rather than every KILN_WARPS-th group: 10% faster at
// 8192 → 28672, where the interleaved order read 128 bytes of a row per warp at a time (`benches/RESULTS.md`,
// thirty-second session; register loads instead of the ring ran at ~1 TB/s, thirty-first).
//
// Defines: KILN_ROWS (1..8), KILN_KIND (1 f16, 2 bf16: activations and output; KILN_OUT_KIND the
// same), KILN_WARPS (warps a cube), KILN_NESTED (1: double-quantized scales), KILN_UNROLL (spans
// a group: 2 or 4), KILN_STAGES (slots a ring), KILN_MIN_BLOCKS (cubes an SM should hold: the
// register budget). kiln places `cuda_out.cuh` (the output element) before this source.

#define KILN_THREADS (KILN_WARPS * 32)
#define KILN_SPAN 64
// Bytes of one feature's row in a slot: its spans (32 bytes each) and 32 bytes of padding, so a
// warp's 8-byte reads of 8 rows × 4 lanes land in distinct banks.
#define KILN_ROW_BYTES (KILN_UNROLL * 32 + 32)
#define KILN_SLOT_BYTES (16 * KILN_ROW_BYTES)
#define KILN_TABLE_BYTES (256 * 32 * 4)

#if KILN_KIND == 1
#define KILN_MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#else
#define KILN_MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#endif

__device__ __forceinline__ void kiln_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(KILN_MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A span's first step: C is zero, so no accumulator is cleared first.
__device__ __forceinline__ void kiln_mma_first(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(KILN_MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

__device__ __forceinline__ unsigned kiln_lds(unsigned addr) {
    unsigned v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

__device__ __forceinline__ uint2 kiln_lds2(unsigned addr) {
    uint2 v;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}

// The table entry of byte `b` of `word` for this lane: entry e of lane l at byte 128·e + 4·l.
__device__ __forceinline__ unsigned kiln_pair(unsigned lane_table, unsigned word, int b) {
    return kiln_lds(lane_table + (__byte_perm(word, 0, 0x4440 + b) << 7));
}

struct Params {
    unsigned n;      // output features
    unsigned k;      // row length, a multiple of `block`
    unsigned block;  // elements a scale, a power-of-two multiple of 64
    unsigned tiles;  // ⌈n / 16⌉
};

struct Scales {
    const float* __restrict__ absmax;
    const unsigned* __restrict__ codes;
    const float* nested_code;  // the cube's copy in shared memory
    float offset;

    // The scale of block `b`: as the portable kernel's `block_scale`.
    __device__ __forceinline__ float get(size_t b) const {
#if KILN_NESTED
        const unsigned q = (__ldg(codes + b / 4) >> (8 * (b % 4))) & 0xffu;
        return nested_code[q] * __ldg(absmax + b / 256) + offset;
#else
        return __ldg(absmax + b);
#endif
    }
};

extern "C" __global__ void __launch_bounds__(KILN_THREADS, KILN_MIN_BLOCKS) kiln_nf4_gemv_mma(
    const uint4* __restrict__ x, const unsigned char* __restrict__ words, const float* __restrict__ code,
    const float* __restrict__ absmax, const unsigned* __restrict__ absmax_codes, const float* __restrict__ nested_code,
    const float* __restrict__ offset, unsigned short* __restrict__ out, const __grid_constant__ Params p) {
    extern __shared__ uint4 kiln_shared_words[];
    __shared__ float partial[KILN_WARPS][4][32];
#if KILN_NESTED
    __shared__ float book[256];  // the nested code book
#endif
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    const unsigned shared = (unsigned)__cvta_generic_to_shared(kiln_shared_words);
    const unsigned lane_table = shared + lane * 4;
    const unsigned ring = shared + KILN_TABLE_BYTES + warp * KILN_STAGES * KILN_SLOT_BYTES;

    const unsigned spans = p.k / KILN_SPAN, groups = (spans + KILN_UNROLL - 1) / KILN_UNROLL;
    const unsigned row_bytes = p.k / 2;
    const unsigned span_shift = __ffs(p.block / KILN_SPAN) - 1;  // spans a block = 1 << span_shift
    const unsigned blocks_per_row = p.k / p.block;
    // The warp's groups of every tile: a contiguous range (the first `groups % WARPS` warps take
    // one more), so consecutive groups of a warp are consecutive bytes of its rows.
    const unsigned per_warp = groups / KILN_WARPS, extra = groups % KILN_WARPS;
    const unsigned g_begin = warp * per_warp + min(warp, extra), g_end = g_begin + per_warp + (warp < extra);

    // The copy cursor: the next group this warp copies (its tile, group, slot). A lane copies 16
    // bytes, part `lane % parts` of rows lane / parts + (32 / parts)·i.
    constexpr unsigned parts = 2 * KILN_UNROLL, pass_rows = 32 / parts;
    unsigned c_tile = blockIdx.x, c_group = g_begin, c_slot = 0;
    const unsigned c_row = lane / parts, c_part = lane % parts;
    const unsigned c_dst = ring + c_row * KILN_ROW_BYTES + c_part * 16;
    const unsigned char* c_src[KILN_UNROLL];
    auto c_rows = [&]() {
#pragma unroll
        for (int i = 0; i < KILN_UNROLL; ++i)
            // Rows past `n` hold the last feature's bytes and are never stored.
            c_src[i] = words + (size_t)min(c_tile * 16 + c_row + pass_rows * i, p.n - 1) * row_bytes + c_part * 16;
    };
    c_rows();
    auto issue = [&]() {
        if (g_begin < g_end && c_tile < p.tiles) {
            const unsigned first = c_group * KILN_UNROLL;
            if (first + c_part / 2 < spans) {
#pragma unroll
                for (int i = 0; i < KILN_UNROLL; ++i) {
                    const unsigned to = c_dst + c_slot * KILN_SLOT_BYTES + i * pass_rows * KILN_ROW_BYTES;
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(c_src[i] + first * 32));
                }
            }
            if (++c_group == g_end) {
                c_group = g_begin;
                c_tile += gridDim.x;
                c_rows();
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
        c_slot = c_slot + 1 == KILN_STAGES ? 0 : c_slot + 1;
    };
#pragma unroll
    for (unsigned j = 0; j < KILN_STAGES - 1; ++j) issue();

    for (unsigned e = tid; e < 256; e += KILN_THREADS) {
#if KILN_NESTED
        book[e] = __ldg(nested_code + e);
#endif
        const unsigned v = (unsigned)kiln_out(__ldg(code + (e >> 4))) | ((unsigned)kiln_out(__ldg(code + (e & 15))) << 16);
        uint4* entry = kiln_shared_words + e * 8;
#pragma unroll
        for (int c = 0; c < 8; ++c) entry[c] = make_uint4(v, v, v, v);
    }
    __syncthreads();

    // The scale cursor, one group ahead of the products: lane (g, t) fetches the scales of span
    // first + t of rows g and g + 8, which the group's span t then takes by shuffle.
#if KILN_NESTED
    const Scales scales{absmax, absmax_codes, book, __ldg(offset)};
#else
    const Scales scales{absmax, absmax_codes, nullptr, 0.f};
#endif
    unsigned s_tile = blockIdx.x, s_group = g_begin;
    float own0 = 0.f, own1 = 0.f;
    auto fetch = [&]() {
        if (g_begin < g_end && s_tile < p.tiles) {
            const unsigned span = s_group * KILN_UNROLL + t;
            if (t < KILN_UNROLL && span < spans) {
                const unsigned b = span >> span_shift;
                own0 = scales.get((size_t)min(s_tile * 16 + g, p.n - 1) * blocks_per_row + b);
                own1 = scales.get((size_t)min(s_tile * 16 + g + 8, p.n - 1) * blocks_per_row + b);
            }
            if (++s_group == g_end) {
                s_group = g_begin;
                s_tile += gridDim.x;
            }
        }
    };
    fetch();
    // Lanes past the last activation row read row 0 again: their MMA columns are never stored.
    const uint4* x_lane = x + (size_t)(g < KILN_ROWS ? g : 0) * (p.k / 8) + 2 * t;
    unsigned slot = 0;

    for (unsigned tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (unsigned group = g_begin; group < g_end; ++group) {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(KILN_STAGES - 2) : "memory");
            __syncwarp();
            issue();
            const float cur0 = own0, cur1 = own1;
            fetch();
            const unsigned first = group * KILN_UNROLL;
            const unsigned at = ring + slot * KILN_SLOT_BYTES + g * KILN_ROW_BYTES + t * 8;
            slot = slot + 1 == KILN_STAGES ? 0 : slot + 1;
            // One span: its four MMA steps into a fresh accumulator, then scaled into the sum.
            auto span = [&](int u) {
                const float sc0 = __shfl_sync(0xffffffffu, cur0, g * 4 + u), sc1 = __shfl_sync(0xffffffffu, cur1, g * 4 + u);
                const uint2 a0 = kiln_lds2(at + u * 32);
                const uint2 a1 = kiln_lds2(at + 8 * KILN_ROW_BYTES + u * 32);
                const uint4 b0 = __ldg(x_lane + (first + u) * 8), b1 = __ldg(x_lane + (first + u) * 8 + 1);
                float c[4];
#pragma unroll
                for (int st = 0; st < 4; ++st) {
                    const unsigned wg = st < 2 ? a0.x : a0.y, wg8 = st < 2 ? a1.x : a1.y;
                    const int byte = 2 * (st % 2);
                    const uint4 xb = st < 2 ? b0 : b1;
                    // Bytes 2·st and 2·st + 1 of rows g and g + 8; elements 4·st … 4·st + 3 of `x`.
                    const unsigned a[4] = {kiln_pair(lane_table, wg, byte), kiln_pair(lane_table, wg8, byte),
                                           kiln_pair(lane_table, wg, byte + 1), kiln_pair(lane_table, wg8, byte + 1)};
                    if (st == 0) kiln_mma_first(c, a, xb.x, xb.y);
                    else kiln_mma(c, a, st % 2 ? xb.z : xb.x, st % 2 ? xb.w : xb.y);
                }
                acc[0] += c[0] * sc0;
                acc[1] += c[1] * sc0;
                acc[2] += c[2] * sc1;
                acc[3] += c[3] * sc1;
            };
            if (first + KILN_UNROLL <= spans) {
#pragma unroll
                for (int u = 0; u < KILN_UNROLL; ++u) span(u);
            } else {
#pragma unroll
                for (int u = 0; u < KILN_UNROLL; ++u)
                    if (first + u < spans) span(u);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) partial[warp][i][lane] = acc[i];
        __syncthreads();
        if (warp == 0) {
            // Lane (g, t) holds rows g (acc 0, 1) and g + 8 (acc 2, 3) for activation rows 2t, 2t + 1.
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < KILN_WARPS; ++w) v += partial[w][i][lane];
                const unsigned feature = tile * 16 + g + (i >= 2 ? 8 : 0), row = 2 * t + i % 2;
                if (feature < p.n && row < KILN_ROWS) out[(size_t)row * p.n + feature] = kiln_out(v);
            }
        }
        __syncthreads();
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
}
