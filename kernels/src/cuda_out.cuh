// The output element of kiln's CUDA C++ kernels that write f32, f16 or bf16 (`ternary/gemv.cu`,
// `ternary/gemm.cu`, `nf4/gemv.cu`), by `KILN_OUT_KIND` (0 f32, 1 f16, 2 bf16, as `FloatKind`
// numbers them): `out_t` and `kiln_out`, which rounds an f32 to it (to nearest, ties to even).
// kiln places this file ([`crate::cuda_source::OUT_ELEMENT`]) before such a kernel's source.

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
