// The output element of kiln's CUDA C++ kernels that write f32, f16 or bf16 (`ternary/gemv.cu`,
// `ternary/gemm.cu`, `ternary/grad.cu`, `nf4/gemv.cu`), by `KILN_OUT_KIND` (0 f32, 1 f16, 2 bf16,
// as `FloatKind` numbers them): `out_t` and `kiln_out`, which rounds an f32 to it (to nearest,
// ties to even); for the warpgroup-MMA kernels, `stage_transposed`, which puts a thread's
// accumulators into an output tile in shared memory, and `store_tile`, which writes that tile
// out. kiln places this file ([`crate::cuda_source::OUT_ELEMENT`]) before such a kernel's source.

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

// Stages this thread's fragment of a warpgroup MMA's `m64nN` accumulators (N = 8 J) into an output
// tile in shared memory, transposed: accumulator `i = 4j + 2h + e` holds MMA row `row + 8h` (here a
// tile column; `row` is the thread's first, lane / 4 into its warp's 16) and MMA column
// `8j + 2t + e` with t = lane % 4 (here a tile row, `pitch` elements apart); `value(i, tile_row, h)`
// gives the element.
template <int J, typename Value>
__device__ __forceinline__ void stage_transposed(out_t* tile, int pitch, int row, int t, Value value) {
    #pragma unroll
    for (int j = 0; j < J; ++j) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) tile[(8 * j + 2 * t + e) * pitch + row + 8 * h] = value(4 * j + 2 * h + e, 8 * j + 2 * t + e, h);
        }
    }
}

// Copies rows `row0 …` and columns `col0 …` of a dense `[rows, width]` output from a tile of ROWS
// × COLS elements staged in shared memory (rows `pitch` elements apart), clipped to the output:
// the cube's THREADS threads copy 16-byte pieces along each row, element by element where the
// output row is not 16-byte aligned or a piece runs past `width`.
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void store_tile(out_t* out, const out_t* tile, int pitch, unsigned rows, unsigned width, unsigned row0, unsigned col0) {
    constexpr int PER = 16 / sizeof(out_t), CHUNKS = COLS / PER;
    const bool aligned = (width * sizeof(out_t)) % 16 == 0;
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        if (row0 + r >= rows) break;
        const unsigned col = col0 + c * PER;
        out_t* dst = out + (unsigned long long)(row0 + r) * width + col;
        const out_t* src = tile + r * pitch + c * PER;
        if (aligned && col + PER <= width) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int e = 0; e < PER && col + e < width; ++e) dst[e] = src[e];
        }
    }
}
