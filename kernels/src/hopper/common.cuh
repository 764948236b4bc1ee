// Hopper building blocks shared by kiln's CUDA C++ kernels on warpgroup MMA (flash attention's
// `wgmma/`, the ternary GEMM and input gradient): shared-memory addresses, 16-byte `cp.async`
// copies, mbarriers for bulk copies, wgmma descriptors and synchronization, and the register
// fences that keep ptxas from moving values across an asynchronous MMA. kiln places this file
// first, before a kernel's wrappers and source.
//
// A 128-byte-swizzled tile stores rows of 128 bytes: the 16-byte chunk `c` of row `r` sits at
// chunk `c ^ (r % 8)` of the row, the layout the descriptors' 128-byte swizzle mode names.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

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

// mbarriers on which bulk copies (`cp.async.bulk`, TMA) land: initialised by one thread for one
// arrival (the thread that issues the copies, announcing their bytes) before a cube barrier,
// then waited on by phase parity.
__device__ __forceinline__ void barrier_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}

// Makes the barriers' initialisation visible to the async proxy that completes the copies.
__device__ __forceinline__ void barrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// The issuing thread's arrival, announcing the `bytes` its copies will complete.
__device__ __forceinline__ void barrier_expect(u32 bar, u32 bytes) {
    asm volatile("{ .reg .b64 s; mbarrier.arrive.expect_tx.shared::cta.b64 s, [%0], %1; }" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void barrier_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

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

// Keeps the compiler from moving reads or writes of the accumulators `d` across an asynchronous
// MMA's wait.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N>
__device__ __forceinline__ void fence_accumulators(int (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// Keeps register operands of an asynchronous MMA live up to this point (place it after the
// wgmma's wait): ptxas (CUDA 13.0) otherwise treats a register A operand as dead once the wgmma
// is issued and hands its registers to later values while the tensor cores still read them.
template <int N>
__device__ __forceinline__ void keep_operands(const u32 (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" ::"r"(r[i]) : "memory");
}
