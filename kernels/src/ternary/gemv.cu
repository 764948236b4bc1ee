// W2A8 GEMV with the 4-way byte dot product (`__dp4a`), which CubeCL's IR has no instruction for.
// Layouts as in `mod.rs`: a weight row is `kv` 16-byte vectors of four words (64 two-bit codes
// `w + 1`), an activation row `4 · kv` vectors of four words (sixteen int8 codes each).
//
// `KILN_T` threads share a weight row along k (a power of two up to 32, so the sum is a shuffle
// reduction), and each thread takes `KILN_FPT` output features, so one load of activations
// serves that many weight rows. The codes are 0..2, so `dp4a(codes, x)` sums `(w + 1) · x` and the
// row's code sum `Σx` (from the quantize kernel) is subtracted at the end.
// Defines: KILN_ROWS (activation rows, 1..8), KILN_T, KILN_FPT, KILN_OUT_KIND (0 f32, 1 f16, 2 bf16).

#if KILN_OUT_KIND == 0
typedef float out_t;
__device__ __forceinline__ out_t kiln_out(float v) { return v; }
#else
typedef unsigned short out_t;
__device__ __forceinline__ out_t kiln_out(float v) {
    unsigned short r;
#if KILN_OUT_KIND == 1
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
#endif
    return r;
}
#endif

struct Params {
    unsigned n;      // output features
    unsigned kv;     // 16-byte weight vectors per row
    unsigned group;  // output rows per weight scale
};

__device__ __forceinline__ int dot16(unsigned word, uint4 a, int acc) {
    acc = __dp4a((int)(word & 0x03030303u), (int)a.x, acc);
    acc = __dp4a((int)((word >> 2) & 0x03030303u), (int)a.y, acc);
    acc = __dp4a((int)((word >> 4) & 0x03030303u), (int)a.z, acc);
    return __dp4a((int)((word >> 6) & 0x03030303u), (int)a.w, acc);
}

extern "C" __global__ void __launch_bounds__(256) kiln_ternary_gemv(
    const uint4* __restrict__ x, const float* __restrict__ x_scales, const float* __restrict__ x_sums,
    const uint4* __restrict__ w, const float* __restrict__ w_scales, out_t* __restrict__ out,
    const __grid_constant__ Params p) {
    const unsigned lane = threadIdx.x % KILN_T;
    const unsigned slot = (blockIdx.x * blockDim.x + threadIdx.x) / KILN_T;
    const unsigned f0 = slot * KILN_FPT;
    int acc[KILN_FPT][KILN_ROWS];
#pragma unroll
    for (int f = 0; f < KILN_FPT; ++f)
#pragma unroll
        for (int r = 0; r < KILN_ROWS; ++r) acc[f][r] = 0;

    if (f0 < p.n) {
        const uint4* wrow[KILN_FPT];
#pragma unroll
        for (int f = 0; f < KILN_FPT; ++f) wrow[f] = w + (size_t)(f0 + f < p.n ? f0 + f : p.n - 1) * p.kv;
#pragma unroll 4
        for (unsigned v = lane; v < p.kv; v += KILN_T) {
            uint4 wv[KILN_FPT];
#pragma unroll
            for (int f = 0; f < KILN_FPT; ++f) wv[f] = __ldg(wrow[f] + v);
#pragma unroll
            for (int r = 0; r < KILN_ROWS; ++r) {
                const uint4* xa = x + ((size_t)r * p.kv + v) * 4;
                const uint4 a0 = __ldg(xa), a1 = __ldg(xa + 1), a2 = __ldg(xa + 2), a3 = __ldg(xa + 3);
#pragma unroll
                for (int f = 0; f < KILN_FPT; ++f) {
                    int s = acc[f][r];
                    s = dot16(wv[f].x, a0, s);
                    s = dot16(wv[f].y, a1, s);
                    s = dot16(wv[f].z, a2, s);
                    acc[f][r] = dot16(wv[f].w, a3, s);
                }
            }
        }
    }
#pragma unroll
    for (int f = 0; f < KILN_FPT; ++f)
#pragma unroll
        for (int r = 0; r < KILN_ROWS; ++r) {
            int s = acc[f][r];
#pragma unroll
            for (int o = KILN_T / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o, KILN_T);
            acc[f][r] = s;
        }
    if (lane == 0) {
#pragma unroll
        for (int f = 0; f < KILN_FPT; ++f) {
            const unsigned feature = f0 + f;
            if (feature < p.n) {
                const float sw = w_scales[feature / p.group];
#pragma unroll
                for (int r = 0; r < KILN_ROWS; ++r) {
                    const int total = acc[f][r] - (int)x_sums[r];
                    out[(size_t)r * p.n + feature] = kiln_out((float)total / (x_scales[r] * sw));
                }
            }
        }
    }
}
