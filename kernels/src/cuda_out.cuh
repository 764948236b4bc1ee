// The output element of kiln's CUDA C++ kernels that write f32, f16 or bf16 (`ternary/gemv.cu`,
// `ternary/gemm.cu`, `ternary/grad.cu`, `nf4/gemv.cu`, `lora/linear.cu`), by `KILN_OUT_KIND` (0
// f32, 1 f16, 2 bf16, as `FloatKind` numbers them): `out_t` and `kiln_out`, which rounds an f32 to
// it (to nearest, ties to even), and for 16-bit kinds `kiln_float` (an element's value) and
// `kiln_out2`, which rounds two into a packed pair; for the warpgroup-MMA kernels,
// `stage_transposed` (and for 16-bit kinds `stage_pairs_transposed` and, onto a tile that holds a
// residual, `stage_pairs_transposed_onto`), which puts a thread's accumulators into an output tile
// in shared memory, and `store_tile`, which writes that tile out. kiln places this file
// ([`crate::cuda_source::OUT_ELEMENT`]) before such a kernel's source.

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

// A 16-bit element's value.
__device__ __forceinline__ float kiln_float(out_t v) {
#if KILN_OUT_KIND == 1
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#else
    return __uint_as_float((unsigned)v << 16);
#endif
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // (the paired conversions' PTX needs sm_80)
// `lo` and `hi` rounded to out_t, packed with `lo` in the low half.
__device__ __forceinline__ unsigned kiln_out2(float lo, float hi) {
    unsigned r;
#if KILN_OUT_KIND == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
#endif
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

#if KILN_OUT_KIND != 0 && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900)
// `stage_transposed` for 16-bit elements by `stmatrix` (compute capability 9.0): four 8 × 8
// matrices a store. `pair(j, h)` gives the packed elements of MMA columns 8j + 2t and 8j + 2t + 1
// (t = lane % 4; here tile rows, the first in the low half) at MMA row `first + lane / 4 + 8h`
// (here a tile column), for j < J; `first` is the warp's first MMA row. Pairs (j, 0), (j, 1),
// (j + 1, 0), (j + 1, 1) are four matrices in the MMA fragment layout, which `.trans` writes with
// the tile's rows along MMA columns: lane l names the address of row `l % 8` of matrix `l / 8`.
// One instruction where `stage_transposed` takes eight 2-byte stores; `at(row, col)` is the shared
// address of the tile's element (row, col), 16-byte aligned where `col` is a multiple of 8.
// The address lane `lane` names for the four `.trans` matrices of column groups j and j + 1.
template <typename At>
__device__ __forceinline__ unsigned pairs_address(At at, int j, int first, int lane) {
    return at(8 * (j + lane / 16) + lane % 8, first + 8 * ((lane / 8) % 2));
}

template <int J, bool CHECKED, typename At, typename Pair, typename Redo>
__device__ __forceinline__ void stage_pairs_transposed_impl(At at, int first, int lane, Pair pair, Redo redo) {
    static_assert(J % 2 == 0, "pairs of column groups");
    #pragma unroll
    for (int j = 0; j < J; j += 2) {
        unsigned v[4];
        bool bad = false;
        #pragma unroll
        for (int m = 0; m < 4; ++m) v[m] = pair(j + m / 2, m % 2, bad);
        if (CHECKED && __any_sync(0xffffffffu, bad)) {
            #pragma unroll
            for (int m = 0; m < 4; ++m) v[m] = redo(j + m / 2, m % 2);
        }
        const unsigned address = pairs_address(at, j, first, lane);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
    }
}

// `stage_pairs_transposed_impl` onto a tile that holds values already (a residual): `pair(j, h,
// old)` is given the pair stored where it goes (read by `ldmatrix .trans` from the same
// addresses, so each lane reads what it will overwrite) and returns the new one.
template <int J, typename At, typename Pair>
__device__ __forceinline__ void stage_pairs_transposed_onto(At at, int first, int lane, Pair pair) {
    static_assert(J % 2 == 0, "pairs of column groups");
    #pragma unroll
    for (int j = 0; j < J; j += 2) {
        const unsigned address = pairs_address(at, j, first, lane);
        unsigned v[4];
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];" : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(address) : "memory");
        #pragma unroll
        for (int m = 0; m < 4; ++m) v[m] = pair(j + m / 2, m % 2, v[m]);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
    }
}

// The address of element (row, col) of a tile whose rows are `pitch` elements apart.
__device__ __forceinline__ auto pitched(unsigned tile, int pitch) {
    return [=](int row, int col) { return tile + (unsigned)(row * pitch + col) * 2; };
}

template <int J, typename Pair>
__device__ __forceinline__ void stage_pairs_transposed(unsigned tile, int pitch, int first, int lane, Pair pair) {
    stage_pairs_transposed_impl<J, false>(pitched(tile, pitch), first, lane, [&](int j, int h, bool&) { return pair(j, h); }, pair);
}

// `stage_pairs_transposed` where `pair(j, h, bad)` may leave a pair to `redo(j, h)` (setting
// `bad`): a store's four pairs are redone together, by the whole warp, when any lane's needs it.
// The slow path is one warp-uniform branch a store, which keeps the pairs' fast steps free to
// overlap.
template <int J, typename Pair, typename Redo>
__device__ __forceinline__ void stage_pairs_transposed_checked(unsigned tile, int pitch, int first, int lane, Pair pair, Redo redo) {
    stage_pairs_transposed_impl<J, true>(pitched(tile, pitch), first, lane, pair, redo);
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
