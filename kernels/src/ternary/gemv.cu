// W2A8 GEMV with the 4-way byte dot product (`__dp4a`) or, for a few rows, the integer MMA:
// instructions CubeCL's IR does not have.
// Layouts as in `mod.rs`: a weight row is `kv` 16-byte vectors of four words (64 two-bit codes
// `w + 1`), an activation row `4 · kv` vectors of four words (sixteen int8 codes each).
//
// `KILN_T` threads share a weight row along k (a power of two up to 32, so the sum is a shuffle
// reduction), and each thread takes `KILN_FPT` output features, so one load of activations
// serves that many weight rows. The codes are 0..2, so `dp4a(codes, x)` sums `(w + 1) · x` and the
// row's code sum `Σx` is subtracted at the end.
//
// Three entry points:
// - `kiln_ternary_gemv` reads activations quantized by a separate kernel (codes, scales, sums);
// - `kiln_ternary_gemv_mma` reads the same for two to eight rows and multiplies on the integer
//   tensor cores instead (below);
// - `kiln_ternary_gemv_fused` takes the float activations: each cube quantizes them into shared
//   memory first (absmax, codes, code sums; the same definition as the activation kernel), then
//   strides over output features, so a product is one launch. Asking L2 for the first weight
//   vectors during that prologue made it slower at every shape measured: the prefetches queue
//   ahead of the activation loads the prologue waits on (`benches/RESULTS.md`, 35th session).
// Defines: KILN_ROWS (activation rows, 1..8), KILN_T, KILN_FPT, KILN_OUT_KIND and KILN_IN_KIND
// (0 f32, 1 f16, 2 bf16; the input kind only matters to the fused entry). kiln places
// `cuda_out.cuh` (the output element) before this source.

// Threads a cube (default 256). The fused entry takes more at long rows: its prologue, which
// every cube runs, is a chain of dependent loads and reductions whose length is the quarters
// a thread quantizes.
#ifndef KILN_CUBE
#define KILN_CUBE 256
#endif

#if KILN_IN_KIND == 0
typedef float in_t;
__device__ __forceinline__ float kiln_in(in_t v) { return v; }
#elif KILN_IN_KIND == 1
typedef unsigned short in_t;
__device__ __forceinline__ float kiln_in(in_t v) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
    return r;
}
#else
typedef unsigned short in_t;
__device__ __forceinline__ float kiln_in(in_t v) { return __uint_as_float((unsigned)v << 16); }
#endif

struct Params {
    unsigned n;      // output features
    unsigned kv;     // 16-byte weight vectors per row
    unsigned group;  // output rows per weight scale
};

struct FusedParams {
    Params shape;         // the weight's, as the two-kernel GEMV takes it
    unsigned k;           // activation row length
    unsigned iterations;  // feature strides per cube
};

__device__ __forceinline__ int dot16(unsigned word, uint4 a, int acc) {
    acc = __dp4a((int)(word & 0x03030303u), (int)a.x, acc);
    acc = __dp4a((int)((word >> 2) & 0x03030303u), (int)a.y, acc);
    acc = __dp4a((int)((word >> 4) & 0x03030303u), (int)a.z, acc);
    return __dp4a((int)((word >> 6) & 0x03030303u), (int)a.w, acc);
}

// Activation codes in global memory, as the activation kernel writes them: row r, vector v,
// quarter j at `x[(r · kv + v) · 4 + j]`.
struct GlobalActs {
    const uint4* __restrict__ x;
    unsigned kv;
    __device__ __forceinline__ uint4 get(int r, int j, unsigned v) const { return __ldg(x + ((size_t)r * kv + v) * 4 + j); }
};

// Activation codes in shared memory, one plane per (row, quarter) so that the threads of a
// weight row, at consecutive `v`, read consecutive 16-byte words (no bank conflicts).
struct SharedActs {
    const uint4* x;
    unsigned kv;
    __device__ __forceinline__ uint4 get(int r, int j, unsigned v) const { return x[(r * 4 + j) * kv + v]; }
};

// One slot: output features `slot · FPT ..` for every activation row. Every thread of the warp
// calls this (the sums are shuffles); slots past `n` load and store nothing.
template <class Acts>
__device__ __forceinline__ void kiln_slot(const Acts acts, const float* sx, const int* sums, const uint4* __restrict__ w,
                                          const float* __restrict__ w_scales, out_t* __restrict__ out, unsigned n,
                                          unsigned group, unsigned slot, unsigned lane) {
    const unsigned f0 = slot * KILN_FPT;
    const unsigned kv = acts.kv;
    int acc[KILN_FPT][KILN_ROWS];
#pragma unroll
    for (int f = 0; f < KILN_FPT; ++f)
#pragma unroll
        for (int r = 0; r < KILN_ROWS; ++r) acc[f][r] = 0;

    if (f0 < n) {
        const uint4* wrow[KILN_FPT];
#pragma unroll
        for (int f = 0; f < KILN_FPT; ++f) wrow[f] = w + (size_t)(f0 + f < n ? f0 + f : n - 1) * kv;
#pragma unroll 4
        for (unsigned v = lane; v < kv; v += KILN_T) {
            uint4 wv[KILN_FPT];
#pragma unroll
            for (int f = 0; f < KILN_FPT; ++f) wv[f] = __ldg(wrow[f] + v);
#pragma unroll
            for (int r = 0; r < KILN_ROWS; ++r) {
                const uint4 a0 = acts.get(r, 0, v), a1 = acts.get(r, 1, v), a2 = acts.get(r, 2, v), a3 = acts.get(r, 3, v);
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
            if (feature < n) {
                const float sw = w_scales[feature / group];
#pragma unroll
                for (int r = 0; r < KILN_ROWS; ++r) out[(size_t)r * n + feature] = kiln_out((float)(acc[f][r] - sums[r]) / (sx[r] * sw));
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(KILN_CUBE) kiln_ternary_gemv(
    const uint4* __restrict__ x, const float* __restrict__ x_scales, const float* __restrict__ x_sums,
    const uint4* __restrict__ w, const float* __restrict__ w_scales, out_t* __restrict__ out,
    const __grid_constant__ Params p) {
    float sx[KILN_ROWS];
    int sums[KILN_ROWS];
#pragma unroll
    for (int r = 0; r < KILN_ROWS; ++r) {
        sx[r] = x_scales[r];
        sums[r] = (int)x_sums[r];
    }
    const unsigned slot = (blockIdx.x * blockDim.x + threadIdx.x) / KILN_T;
    kiln_slot(GlobalActs{x, p.kv}, sx, sums, w, w_scales, out, p.n, p.group, slot, threadIdx.x % KILN_T);
}

// Two to eight activation rows on the integer tensor cores (compute capability 8.0 and up):
// `mma.sync.m16n8k32` with the weight codes (`w + 1`, u8) as A and the activation codes (s8) as
// B, so the rows ride in the MMA's N of 8 and cost about what one row does, where the `dp4a`
// product's work grows with them. A cube owns 16 weight rows and its warps split `k`: a step is
// four consecutive 16-byte vectors, warp `w` takes steps `w, w + warps, …` and lane `(g, t)`
// (`g = lane / 4`, `t = lane % 4`) vector `4 · step + t` of weight rows g and g + 8 and of
// activation row g. A sum over `k` may take its terms in any order, so each lane feeds the MMA
// the codes of its own vector: in the MMA for word `q` and half `h`, elements `16q + 8h + 0..3`
// (A: `(word >> 4h) & 0x03030303`, B: word `2h` of the activation quarter `q`) and `+ 4..7` (A:
// `>> 4h + 2`, B: word `2h + 1`). The warps' 16 × 8 tiles are summed in shared memory.
__device__ __forceinline__ void kiln_mma_u8s8(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(KILN_CUBE) kiln_ternary_gemv_mma(
    const uint4* __restrict__ x, const float* __restrict__ x_scales, const float* __restrict__ x_sums,
    const uint4* __restrict__ w, const float* __restrict__ w_scales, out_t* __restrict__ out,
    const __grid_constant__ Params p) {
    constexpr unsigned warps = KILN_CUBE / 32, mask = 0x03030303u;
    __shared__ int tiles[warps][16 * 8];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const unsigned row0 = blockIdx.x * 16;
    // Rows past `n` read the last row and are not stored; lanes past the activation rows feed zeros.
    const uint4* wa = w + (size_t)min(row0 + g, p.n - 1) * p.kv;
    const uint4* wb = w + (size_t)min(row0 + g + 8, p.n - 1) * p.kv;
    const bool act = g < KILN_ROWS;
    const uint4* xr = x + (size_t)(act ? g : 0) * p.kv * 4;
    int d[4] = {0, 0, 0, 0};
    const unsigned steps = (p.kv + 3) / 4;
#pragma unroll 2
    for (unsigned step = warp; step < steps; step += warps) {
        const unsigned v = 4 * step + t;
        uint4 ta = make_uint4(0, 0, 0, 0), tb = ta, xq[4] = {ta, ta, ta, ta};
        if (v < p.kv) {
            ta = __ldg(wa + v);
            tb = __ldg(wb + v);
            if (act)
#pragma unroll
                for (int q = 0; q < 4; ++q) xq[q] = __ldg(xr + (size_t)v * 4 + q);
        }
        const unsigned a[4] = {ta.x, ta.y, ta.z, ta.w}, b[4] = {tb.x, tb.y, tb.z, tb.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const unsigned xw[4] = {xq[q].x, xq[q].y, xq[q].z, xq[q].w};
#pragma unroll
            for (int h = 0; h < 2; ++h)
                kiln_mma_u8s8(d, (a[q] >> 4 * h) & mask, (b[q] >> 4 * h) & mask, (a[q] >> (4 * h + 2)) & mask,
                              (b[q] >> (4 * h + 2)) & mask, xw[2 * h], xw[2 * h + 1]);
        }
    }
    // D: c0, c1 at weight row g, activation rows 2t, 2t + 1; c2, c3 at weight row g + 8.
    tiles[warp][g * 8 + 2 * t] = d[0];
    tiles[warp][g * 8 + 2 * t + 1] = d[1];
    tiles[warp][(g + 8) * 8 + 2 * t] = d[2];
    tiles[warp][(g + 8) * 8 + 2 * t + 1] = d[3];
    __syncthreads();
    for (unsigned e = threadIdx.x; e < 16 * 8; e += KILN_CUBE) {
        const unsigned feature = row0 + e / 8, r = e % 8;
        if (r < KILN_ROWS && feature < p.n) {
            int acc = 0;
#pragma unroll
            for (unsigned i = 0; i < warps; ++i) acc += tiles[i][e];
            out[(size_t)r * p.n + feature] = kiln_out((float)(acc - (int)x_sums[r]) / (x_scales[r] * w_scales[feature / p.group]));
        }
    }
}

// Each row's `v[r]` reduced over the cube with `op` (every thread gets the results). `scratch`
// holds a value per row and warp; the leading barrier lets a previous call's readers finish.
template <class T, class Op>
__device__ __forceinline__ void kiln_cube_reduce_rows(T (&v)[KILN_ROWS], T* scratch, Op op) {
#pragma unroll
    for (int r = 0; r < KILN_ROWS; ++r)
#pragma unroll
        for (int o = 16; o > 0; o /= 2) v[r] = op(v[r], __shfl_xor_sync(0xffffffffu, v[r], o));
    __syncthreads();
    if (threadIdx.x % 32 == 0)
#pragma unroll
        for (int r = 0; r < KILN_ROWS; ++r) scratch[r * (KILN_CUBE / 32) + threadIdx.x / 32] = v[r];
    __syncthreads();
#pragma unroll
    for (int r = 0; r < KILN_ROWS; ++r) {
        T a = scratch[r * (KILN_CUBE / 32)];
#pragma unroll
        for (int i = 1; i < KILN_CUBE / 32; ++i) a = op(a, scratch[r * (KILN_CUBE / 32) + i]);
        v[r] = a;
    }
}

struct KilnMax {
    // `b > a` keeps `a` when `b` is NaN (whose code is 0 anyway), as the activation kernel does.
    __device__ __forceinline__ float operator()(float a, float b) const { return b > a ? b : a; }
};
struct KilnSum {
    __device__ __forceinline__ int operator()(int a, int b) const { return a + b; }
};

// The int8 code of `v · s`: rounded half to even, clamped to [−128, 127]; NaN gives 0 (the
// comparisons are false and the conversion of NaN is 0).
__device__ __forceinline__ int kiln_code(float v, float s) {
    float q = rintf(v * s);
    q = q < -128.f ? -128.f : (q > 127.f ? 127.f : q);
    return (int)q;
}

// Activations `16q .. 16q + 15` of `row` (zeros past `k`): one quarter of a 64-code vector.
// `vec`: the row is aligned for 16-byte loads and `k` is a multiple of 16 (so a quarter that
// starts before `k` ends there too).
__device__ __forceinline__ void kiln_quarter(const in_t* __restrict__ row, unsigned k, unsigned q, bool vec, float (&v)[16]) {
    const unsigned j0 = q * 16;
    if (vec && j0 < k) {
        const uint4* p = (const uint4*)(row + j0);
#if KILN_IN_KIND == 0
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 a = __ldg(p + i);
            v[4 * i] = __uint_as_float(a.x), v[4 * i + 1] = __uint_as_float(a.y);
            v[4 * i + 2] = __uint_as_float(a.z), v[4 * i + 3] = __uint_as_float(a.w);
        }
#else
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const uint4 a = __ldg(p + i);
            const unsigned u[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                v[8 * i + 2 * h] = kiln_in((in_t)(u[h] & 0xffffu));
                v[8 * i + 2 * h + 1] = kiln_in((in_t)(u[h] >> 16));
            }
        }
#endif
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = j0 + i < k ? kiln_in(row[j0 + i]) : 0.f;
    }
}

extern "C" __global__ void __launch_bounds__(KILN_CUBE) kiln_ternary_gemv_fused(
    const in_t* __restrict__ x, const uint4* __restrict__ w, const float* __restrict__ w_scales, out_t* __restrict__ out,
    const __grid_constant__ FusedParams p) {
    extern __shared__ uint4 kiln_codes[];  // [rows][4][kv] (SharedActs)
    __shared__ float max_scratch[KILN_ROWS * KILN_CUBE / 32];
    __shared__ int sum_scratch[KILN_ROWS * KILN_CUBE / 32];
    const unsigned tid = threadIdx.x;
    const bool vec = p.k % 16 == 0 && ((size_t)x & 15) == 0;
    const unsigned quarters = p.shape.kv * 4;
    float sx[KILN_ROWS];
    int sums[KILN_ROWS];
#pragma unroll
    for (int r = 0; r < KILN_ROWS; ++r) {
        float m = 0.f;
        for (unsigned q = tid; q < quarters; q += KILN_CUBE) {
            float v[16];
            kiln_quarter(x + (size_t)r * p.k, p.k, q, vec, v);
#pragma unroll
            for (int i = 0; i < 16; ++i) m = KilnMax()(m, fabsf(v[i]));
        }
        sx[r] = m;
    }
    kiln_cube_reduce_rows(sx, max_scratch, KilnMax());
#pragma unroll
    for (int r = 0; r < KILN_ROWS; ++r) {
        const float s = 127.f / fmaxf(sx[r], 1e-5f);
        int sum = 0;
        for (unsigned q = tid; q < quarters; q += KILN_CUBE) {
            float v[16];
            kiln_quarter(x + (size_t)r * p.k, p.k, q, vec, v);
            unsigned words[4] = {0, 0, 0, 0};
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int c = kiln_code(v[i], s);
                sum += c;
                words[i / 4] |= ((unsigned)c & 0xffu) << (8 * (i % 4));
            }
            // Quarter `q` of the row is quarter `q % 4` of vector `q / 4`.
            kiln_codes[(r * 4 + q % 4) * p.shape.kv + q / 4] = make_uint4(words[0], words[1], words[2], words[3]);
        }
        sx[r] = s;
        sums[r] = sum;
    }
    kiln_cube_reduce_rows(sums, sum_scratch, KilnSum());
    __syncthreads();
    const SharedActs acts{kiln_codes, p.shape.kv};
    for (unsigned it = 0; it < p.iterations; ++it) {
        const unsigned slot = ((it * gridDim.x + blockIdx.x) * KILN_CUBE + tid) / KILN_T;
        kiln_slot(acts, sx, sums, w, w_scales, out, p.shape.n, p.shape.group, slot, tid % KILN_T);
    }
}
