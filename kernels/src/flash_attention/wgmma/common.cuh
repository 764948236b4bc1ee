// Helpers of the Hopper attention kernels (`forward.cu`, `backward.cu`) on top of
// `kernels/src/hopper/common.cuh`: operand rows, staging `[rows, KILN_D]` tiles with `cp.async`,
// and element packing. kiln places this file after the Hopper header and `wgmma.cuh` and before a
// kernel's source; `KILN_D`, `KILN_F16` are defined by then.
//
// A swizzled tile is `[KILN_D / 64][rows][64]`: 128-byte rows of 64 elements, swizzled as the
// Hopper header describes.

#define NEG_INF (-__int_as_float(0x7f800000))

// Element strides of a `[batch, heads, len, d]` operand, as a launch passes them (three 32-bit
// words; `RowStrides` on the Rust side).
struct RowStrides {
    u32 batch, head, row;
};

// Row `row` of (batch, head) in an operand starting at `base`.
__device__ __forceinline__ const u16* row_at(const u16* base, RowStrides s, u32 batch, u32 head, int row) {
    return base + (u64)batch * s.batch + (u64)head * s.head + (u64)row * s.row;
}

__device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
#if KILN_F16
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Stages `TILE_ROWS` rows of `KILN_D` elements (row stride `stride` elements) into the swizzled
// tile at `tile`, `THREAD_COUNT` threads sharing the copies; rows at or past `valid` are
// zero-filled (masked scores, and zeros keep 0·garbage out of the products).
template <int TILE_ROWS, int THREAD_COUNT>
__device__ __forceinline__ void stage(u32 tile, const u16* src, u32 stride, int valid) {
    constexpr int CHUNKS = KILN_D / 8, TOTAL = TILE_ROWS * CHUNKS;
    #pragma unroll
    for (int n = 0; n < (TOTAL + THREAD_COUNT - 1) / THREAD_COUNT; ++n) {
        int i = n * THREAD_COUNT + threadIdx.x;
        if (TOTAL % THREAD_COUNT != 0 && i >= TOTAL) break;
        int r = i / CHUNKS, c = i % CHUNKS;
        bool ok = r < valid;
        u32 dst = tile + (c / 8) * (TILE_ROWS * 128) + r * 128 + (((c % 8) ^ (r % 8)) << 4);
        copy16(dst, src + (u64)(ok ? r : 0) * stride + c * 8, ok ? 16 : 0);
    }
}
