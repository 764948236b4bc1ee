// Helpers shared by the Hopper attention kernels (`forward.cu`, `backward.cu`): shared-memory
// addresses, `cp.async` staging into 128-byte-swizzled tiles, wgmma descriptors and
// synchronization, and element packing. kiln places this file after `wgmma.cuh` and before a
// kernel's source; `KILN_D`, `KILN_F16` are defined by then.
//
// A swizzled tile is `[KILN_D / 64][rows][64]`: the 16-byte chunk `c` of row `r` sits at chunk
// `c ^ (r % 8)` of the row's 128 bytes, the layout the descriptors' 128-byte swizzle mode names.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

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

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global → shared, zero-filled when `bytes` is 0.
__device__ __forceinline__ void copy16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Makes this thread's generic-proxy writes to shared memory (cp.async) visible to wgmma.
__device__ __forceinline__ void async_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Matrix descriptor of a 128-byte-swizzled shared-memory operand.
__device__ __forceinline__ u64 descriptor(u32 address, u32 leading_bytes, u32 stride_bytes) {
    return (u64)((address & 0x3FFFF) >> 4) | ((u64)((leading_bytes >> 4) & 0x3FFF) << 16) |
           ((u64)((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
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

// Keeps the compiler from moving reads or writes of the accumulators `d` across an asynchronous
// MMA's wait.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Keeps register operands of an asynchronous MMA live up to this point (place it after the
// wgmma's wait): ptxas (CUDA 13.0) otherwise treats a register A operand as dead once the wgmma
// is issued and hands its registers to later values while the tensor cores still read them.
template <int N>
__device__ __forceinline__ void keep_operands(const u32 (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" ::"r"(r[i]) : "memory");
}
