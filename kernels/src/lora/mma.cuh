// What kiln's LoRA kernels (`dy.cu`, `expand.cu`) share: the f16/bf16 `mma.sync.m16n8k16` with
// f32 accumulators by KILN_KIND (1 f16, 2 bf16), an element's f32 value, and the dropout's hash
// (`kiln_kernels::lora`'s `mix32`: element i is kept when mix32(i ^ key) ≥ threshold). kiln places
// this file after `hopper/common.cuh` and before such a kernel's source.

#if KILN_KIND == 1
#define KILN_MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
// The f32 value of the element in the low half of `v`.
__device__ __forceinline__ float lora_float(u32 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)v));
    return f;
}
#else
#define KILN_MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
__device__ __forceinline__ float lora_float(u32 v) { return __uint_as_float((v & 0xffffu) << 16); }
#endif

__device__ __forceinline__ void lora_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(KILN_MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 lora_mix32(u32 h) {
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}
