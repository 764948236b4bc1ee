// The 4-bit GEMV on the tensor cores: `out[r, f] = Σ_k x[r, k] · code[q(f, k)] · scale(f, k)`
// for up to 8 half-precision activation rows, with `mma.sync.m16n8k16` doing the multiply-adds
// (f32 accumulation), so a weight costs a table lookup per pair and no float math of its own.
//
// Layout (`mod.rs`): bitsandbytes' bytes, two codes a byte, the even element in the high nibble;
// one scale per block of `block` elements of a row (`k` a multiple of `block`, `block` of 64).
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
// Each span's products go to a fresh accumulator that is scaled into the running sum, so the
// block scale is applied in f32 per block, as the portable kernel does.
//
// Warps of a cube split `k` for one tile of 16 features and add their sums through shared
// memory; cubes stride over tiles (the table is filled once per cube). The weight bytes reach a
// warp through its own ring of KILN_STAGES slots in shared memory, each a group of KILN_UNROLL
// spans of the tile's 16 rows, copied with `cp.async` KILN_STAGES − 1 groups ahead of the one
// being multiplied (across tiles too), so HBM always has that much of every warp's reads in
// flight. A first version loaded the groups into registers and waited on each before its
// products: ~1 TB/s on the H100, no faster than the portable kernel; staging the activations
// through the ring too and fetching scales a group ahead cost registers and measured slower
// (`benches/RESULTS.md`, thirty-first session).
//
// Defines: KILN_ROWS (1..8), KILN_KIND (1 f16, 2 bf16: activations and output), KILN_WARPS
// (warps a cube), KILN_NESTED (1: double-quantized scales), KILN_UNROLL (spans a group: 2 or 4),
// KILN_STAGES (slots a ring), KILN_MIN_BLOCKS (cubes an SM should hold: the register budget).

#define KILN_THREADS (KILN_WARPS * 32)
#define KILN_SPAN 64
// Bytes of one feature's row in a slot: its spans (32 bytes each) and 32 bytes of padding, so a
// warp's 8-byte reads of 8 rows × 4 lanes land in distinct banks.
#define KILN_ROW_BYTES (KILN_UNROLL * 32 + 32)
#define KILN_SLOT_BYTES (16 * KILN_ROW_BYTES)
#define KILN_TABLE_BYTES (256 * 32 * 4)

__device__ __forceinline__ unsigned kiln_half_bits(float v) {
    unsigned short r;
#if KILN_KIND == 1
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
#endif
    return r;
}

__device__ __forceinline__ void kiln_mma(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
#if KILN_KIND == 1
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
#endif
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct Params {
    unsigned n;      // output features
    unsigned k;      // row length, a multiple of `block`
    unsigned block;  // elements a scale, a multiple of 64
    unsigned tiles;  // ⌈n / 16⌉
};

struct Scales {
    const float* __restrict__ absmax;
    const unsigned* __restrict__ codes;
    const float* __restrict__ nested_code;
    const float* __restrict__ offset;

    // The scale of block `b`: as the portable kernel's `block_scale`.
    __device__ __forceinline__ float get(size_t b) const {
#if KILN_NESTED
        const unsigned q = (__ldg(codes + b / 4) >> (8 * (b % 4))) & 0xffu;
        return __ldg(nested_code + q) * __ldg(absmax + b / 256) + __ldg(offset);
#else
        return __ldg(absmax + b);
#endif
    }
};

// The table entry of byte `b` of `word` for this lane (`lut` already offset by the lane).
__device__ __forceinline__ unsigned kiln_pair(const unsigned* lut, unsigned word, int b) {
    return lut[((word >> (8 * b)) & 0xffu) * 32];
}

// One warp's stream of groups: item `j` is group `warp + KILN_WARPS · (j % per_tile)` of this
// cube's tile `j / per_tile` (cube `c` takes tiles c, c + cubes, …).
struct Stream {
    const unsigned char* __restrict__ words;
    unsigned n, row_bytes, spans, per_tile, items, warp;

    __device__ __forceinline__ unsigned tile(unsigned j) const { return blockIdx.x + gridDim.x * (j / per_tile); }
    __device__ __forceinline__ unsigned group(unsigned j) const { return warp + KILN_WARPS * (j % per_tile); }

    // Copies item `j`'s bytes (16 rows × the group's spans; rows past `n` repeat the last row)
    // into `slot` as one commit group, empty past the last item so that every lane commits alike.
    __device__ __forceinline__ void issue(unsigned j, unsigned char* slot, unsigned lane) const {
        if (j < items) {
            const unsigned first = group(j) * KILN_UNROLL, tile0 = tile(j) * 16;
#pragma unroll
            for (int i = 0; i < KILN_UNROLL; ++i) {
                const unsigned c = lane + 32 * i, row = c / (2 * KILN_UNROLL), part = c % (2 * KILN_UNROLL);
                if (first + part / 2 < spans) {
                    const unsigned feature = min(tile0 + row, n - 1);
                    const unsigned char* src = words + (size_t)feature * row_bytes + (size_t)first * 32 + part * 16;
                    const unsigned to = (unsigned)__cvta_generic_to_shared(slot + row * KILN_ROW_BYTES + part * 16);
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(src));
                }
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    }
};

extern "C" __global__ void __launch_bounds__(KILN_THREADS, KILN_MIN_BLOCKS) kiln_nf4_gemv_mma(
    const uint4* __restrict__ x, const unsigned char* __restrict__ words, const float* __restrict__ code,
    const float* __restrict__ absmax, const unsigned* __restrict__ absmax_codes, const float* __restrict__ nested_code,
    const float* __restrict__ offset, unsigned short* __restrict__ out, const __grid_constant__ Params p) {
    extern __shared__ uint4 kiln_shared_words[];  // the table, then a ring per warp
    unsigned char* kiln_shared = (unsigned char*)kiln_shared_words;
    __shared__ float partial[KILN_WARPS][4][32];
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    unsigned* lut = (unsigned*)kiln_shared;
    unsigned char* ring = kiln_shared + KILN_TABLE_BYTES + warp * KILN_STAGES * KILN_SLOT_BYTES;

    const unsigned spans = p.k / KILN_SPAN, groups = (spans + KILN_UNROLL - 1) / KILN_UNROLL;
    const unsigned per_tile = warp < groups ? (groups - warp + KILN_WARPS - 1) / KILN_WARPS : 0;
    const unsigned my_tiles = (p.tiles - blockIdx.x + gridDim.x - 1) / gridDim.x;
    const Stream stream{words, p.n, p.k / 2, spans, per_tile, per_tile * my_tiles, warp};
    // The first groups are on their way while the table fills.
#pragma unroll
    for (unsigned j = 0; j < KILN_STAGES - 1; ++j) stream.issue(j, ring + j * KILN_SLOT_BYTES, lane);

    for (unsigned e = tid; e < 256; e += KILN_THREADS) {
        const unsigned v = kiln_half_bits(__ldg(code + (e >> 4))) | (kiln_half_bits(__ldg(code + (e & 15))) << 16);
        uint4* entry = (uint4*)(lut + e * 32);
#pragma unroll
        for (int c = 0; c < 8; ++c) entry[c] = make_uint4(v, v, v, v);
    }
    __syncthreads();

    const unsigned* my_lut = lut + lane;
    const Scales scales{absmax, absmax_codes, nested_code, offset};
    const unsigned blocks_per_row = p.k / p.block, spans_per_block = p.block / KILN_SPAN;
    const bool reads_x = g < KILN_ROWS;
    const uint4* x_lane = x + (size_t)(reads_x ? g : 0) * (p.k / 8) + 2 * t;

    unsigned j = 0;
    for (unsigned tt = 0; tt < my_tiles; ++tt) {
        const unsigned tile = blockIdx.x + gridDim.x * tt;
        // Rows past `n` hold the last feature's bytes and are never stored.
        const unsigned f0 = min(tile * 16 + g, p.n - 1), f1 = min(tile * 16 + g + 8, p.n - 1);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (unsigned q = 0; q < per_tile; ++q, ++j) {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(KILN_STAGES - 2));
            __syncwarp();
            // The slot refilled now was read in the previous step, which every lane has finished.
            stream.issue(j + KILN_STAGES - 1, ring + ((j + KILN_STAGES - 1) % KILN_STAGES) * KILN_SLOT_BYTES, lane);
            const unsigned char* slot = ring + (j % KILN_STAGES) * KILN_SLOT_BYTES;
            const unsigned first = stream.group(j) * KILN_UNROLL;
            // Lane (g, t) finds the scales of span `first + t` for both of its rows; each span's
            // pair is then read from the lane that holds it.
            float own0 = 0.f, own1 = 0.f;
            if (t < KILN_UNROLL && first + t < spans) {
                const unsigned block = (first + t) / spans_per_block;
                own0 = scales.get((size_t)f0 * blocks_per_row + block);
                own1 = scales.get((size_t)f1 * blocks_per_row + block);
            }
#pragma unroll
            for (int u = 0; u < KILN_UNROLL; ++u) {
                const unsigned s = first + u;
                const float sc0 = __shfl_sync(0xffffffffu, own0, g * 4 + u), sc1 = __shfl_sync(0xffffffffu, own1, g * 4 + u);
                if (s >= spans) break;
                const uint2 a0 = *(const uint2*)(slot + g * KILN_ROW_BYTES + u * 32 + t * 8);
                const uint2 a1 = *(const uint2*)(slot + (g + 8) * KILN_ROW_BYTES + u * 32 + t * 8);
                const uint4 zero = make_uint4(0, 0, 0, 0);
                const uint4 b0 = reads_x ? __ldg(x_lane + s * 8) : zero, b1 = reads_x ? __ldg(x_lane + s * 8 + 1) : zero;
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int st = 0; st < 4; ++st) {
                    // Bytes 2·st and 2·st + 1 of rows g and g + 8; elements 4·st … 4·st + 3 of `x`.
                    const unsigned wg = st < 2 ? a0.x : a0.y, wg8 = st < 2 ? a1.x : a1.y;
                    const int byte = 2 * (st % 2);
                    const uint4 xb = st < 2 ? b0 : b1;
                    kiln_mma(c, kiln_pair(my_lut, wg, byte), kiln_pair(my_lut, wg8, byte), kiln_pair(my_lut, wg, byte + 1),
                             kiln_pair(my_lut, wg8, byte + 1), st % 2 ? xb.z : xb.x, st % 2 ? xb.w : xb.y);
                }
                acc[0] += c[0] * sc0;
                acc[1] += c[1] * sc0;
                acc[2] += c[2] * sc1;
                acc[3] += c[3] * sc1;
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
                if (feature < p.n && row < KILN_ROWS) out[(size_t)row * p.n + feature] = (unsigned short)kiln_half_bits(v);
            }
        }
        __syncthreads();
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
}
