// LoRA's input gradient `dx = dropout(dh · A) + prior` in one pass: `L` (`dh`, `[tokens, r]`)
// expanded to the full width by `R` (`A`, `[r, n]`), scaled, dropped out and added to `C` (the
// gradient of `x` registered before, when there is one). As a GEMM, a dropout kernel and an add
// this wrote (and read) the full-width tensor three times; the GEMM alone, output-bound with K =
// r, ran at 1.7 TB/s of writes (18.7 µs for a 4096² output, H200, fiftieth session). kiln runs
// it with a dropout only: without one, cuBLASLt's single product (the prior as its `C`) measured
// as fast or faster in whole steps, and the forward's `y = base + s · h · Bᵀ` through the same
// loop slower (+27 µs a step at 4096 → 11008; same session).
//
// A warp owns 64 output columns (eight MMA n-tiles): it loads their B fragments of `R` once,
// into registers, and walks its cube's tokens 16 rows at a time. A step loads the rows' `C` in
// 16-byte pieces and their A fragments of `L` (r rounded up to MMA steps of 16 with zeros), runs
// `mma.sync.m16n8k16` and stages the f32 products in shared memory; each lane then takes eight
// consecutive columns of a row, scales, applies the dropout mask (element (t, c) kept when
// mix32((t · n + c) ^ key) ≥ threshold, then scaled, as `kiln_kernels::lora`'s dropout kernel
// does), adds `C` in f32, rounds once and stores 16 bytes. Stored from the MMA's fragments (4
// bytes a lane, eight rows a store) the products wrote at half this speed. A cube's four warps
// take four neighbouring column groups of the same rows; the grid's second axis strides over the
// 16-row tiles, sized to the device's resident cubes (no tail wave), and a tile's loads are
// issued while the one before is stored. Rows past `tokens` read zeros and are not stored.
//
// Layouts: dense row-major, 16-byte aligned, `n` and `r` multiples of 8. Defines: KILN_KIND
// (1 f16, 2 bf16; KILN_OUT_KIND the same), KILN_R (r), KILN_DROPOUT and KILN_RESIDUAL (0 or 1). kiln places `hopper/common.cuh`, `cuda_out.cuh` and
// `lora/mma.cuh` before this source.

#define KILN_KSTEPS ((KILN_R + 15) / 16)
#define KILN_WARP_COLUMNS 64
// Warps a cube: four and eight measured alike (probe, fiftieth session).
#define KILN_WARPS 4

struct ExpandParams {
    u32 tokens;     // rows of L, C and out
    u32 n;          // columns of R, C and out
    float scale;    // s
    u32 key;        // the dropout's element key,
    u32 threshold;  // keep threshold
    float keep;     // and kept elements' scale
};

// The pair of `R` elements (k, k + 1) of column `c`, zero past `r`.
__device__ __forceinline__ u32 expand_b(const u16* __restrict__ rt, u32 k, u32 c, u32 n) {
    if (k >= KILN_R) return 0;
    return (u32)rt[(size_t)k * n + c] | ((u32)rt[(size_t)(k + 1) * n + c] << 16);
}

// A warp's staged 16 × 64 tile of f32 products: rows padded to 72 floats.
#define KILN_STAGE_PITCH 72

extern "C" __global__ void __launch_bounds__(KILN_WARPS * 32) kiln_lora_expand(
    const u16* __restrict__ l, const u16* __restrict__ rt, const u16* __restrict__ c_in, u16* __restrict__ out,
    const __grid_constant__ ExpandParams p) {
    __shared__ __align__(16) float staged[KILN_WARPS][16 * KILN_STAGE_PITCH];
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const u32 col0 = (blockIdx.x * KILN_WARPS + warp) * KILN_WARP_COLUMNS;
    if (col0 >= p.n) return;
    float* const tile = staged[warp];
    u32 b[8][KILN_KSTEPS][2];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 c = min(col0 + 8 * j + g, p.n - 1);
#pragma unroll
        for (int s = 0; s < KILN_KSTEPS; ++s) {
            b[j][s][0] = expand_b(rt, 16 * s + 2 * t, c, p.n);
            b[j][s][1] = expand_b(rt, 16 * s + 2 * t + 8, c, p.n);
        }
    }
    // In the store phase lane L owns the 8 columns 8 (L % 8) … of rows L / 8 + 4q, q < 4: a
    // warp's store covers four rows of 128 bytes.
    const u32 chunk_col = col0 + 8 * (lane % 8);
    const bool chunk_in = chunk_col < p.n;
    // The next tile's `C` and A fragments load while this one's products are stored.
    auto load = [&](u32 row0, u32 (&a)[KILN_KSTEPS][4], uint4 (&cv)[4]) {
#if KILN_RESIDUAL
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 row = row0 + lane / 8 + 4 * q;
            cv[q] = row < p.tokens && chunk_in ? *reinterpret_cast<const uint4*>(c_in + (size_t)row * p.n + chunk_col) : make_uint4(0, 0, 0, 0);
        }
#endif
        const u32 r_lo = row0 + g, r_hi = row0 + g + 8;
        const bool in_lo = r_lo < p.tokens, in_hi = r_hi < p.tokens;
#pragma unroll
        for (int s = 0; s < KILN_KSTEPS; ++s) {
            const u32 k = 16 * s + 2 * t;
            auto pair = [&](bool in, u32 row, u32 kk) -> u32 {
                return in && kk < KILN_R ? *reinterpret_cast<const u32*>(l + (size_t)row * KILN_R + kk) : 0u;
            };
            a[s][0] = pair(in_lo, r_lo, k), a[s][1] = pair(in_hi, r_hi, k);
            a[s][2] = pair(in_lo, r_lo, k + 8), a[s][3] = pair(in_hi, r_hi, k + 8);
        }
    };
    const u32 tiles = (p.tokens + 15) / 16;
    u32 a[KILN_KSTEPS][4], a_next[KILN_KSTEPS][4];
    uint4 cv[4], cv_next[4];
    if (blockIdx.y < tiles) load(blockIdx.y * 16, a, cv);
    for (u32 m = blockIdx.y; m < tiles; m += gridDim.y) {
        const u32 row0 = m * 16;
        if (m + gridDim.y < tiles) load((m + gridDim.y) * 16, a_next, cv_next);
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int s = 0; s < KILN_KSTEPS; ++s) lora_mma(acc, a[s], b[j][s][0], b[j][s][1]);
            *reinterpret_cast<float2*>(tile + g * KILN_STAGE_PITCH + 8 * j + 2 * t) = make_float2(acc[0], acc[1]);
            *reinterpret_cast<float2*>(tile + (g + 8) * KILN_STAGE_PITCH + 8 * j + 2 * t) = make_float2(acc[2], acc[3]);
        }
        __syncwarp();
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 row = row0 + lane / 8 + 4 * q;
            if (row >= p.tokens || !chunk_in) continue;
            const float* src = tile + (lane / 8 + 4 * q) * KILN_STAGE_PITCH + 8 * (lane % 8);
            const float4 v0 = *reinterpret_cast<const float4*>(src), v1 = *reinterpret_cast<const float4*>(src + 4);
            float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                v[e] *= p.scale;
#if KILN_DROPOUT
                v[e] = lora_mix32((row * p.n + chunk_col + e) ^ p.key) >= p.threshold ? v[e] * p.keep : 0.f;
#endif
            }
#if KILN_RESIDUAL
            const u32 cw[4] = {cv[q].x, cv[q].y, cv[q].z, cv[q].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) v[2 * e] += lora_float(cw[e]), v[2 * e + 1] += lora_float(cw[e] >> 16);
#endif
            *reinterpret_cast<uint4*>(out + (size_t)row * p.n + chunk_col) =
                make_uint4(kiln_out2(v[0], v[1]), kiln_out2(v[2], v[3]), kiln_out2(v[4], v[5]), kiln_out2(v[6], v[7]));
        }
#pragma unroll
        for (int s = 0; s < KILN_KSTEPS; ++s)
#pragma unroll
            for (int e = 0; e < 4; ++e) a[s][e] = a_next[s][e];
#pragma unroll
        for (int q = 0; q < 4; ++q) cv[q] = cv_next[q];
    }
}
