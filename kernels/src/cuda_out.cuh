// The output element of kiln's CUDA C++ kernels that write f32, f16 or bf16 (`ternary/gemv.cu`,
// `ternary/gemm.cu`, `ternary/grad.cu`, `nf4/gemv.cu`), by `KILN_OUT_KIND` (0 f32, 1 f16, 2 bf16,
// as `FloatKind` numbers them): `out_t` and `kiln_out`, which rounds an f32 to it (to nearest,
// ties to even), and `store_tile`, which writes an output tile staged in shared memory. kiln
// places this file ([`crate::cuda_source::OUT_ELEMENT`]) before such a kernel's source.

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
