//! LoRA's input dropout, regenerated instead of stored: element `i` of the `[rows, in]` input is
//! kept when `mix32(i ^ key) ≥ threshold` and then scaled by `1 / (1 − p)`, so the backward rebuilds
//! the same mask from the seed instead of keeping a mask tensor between the passes. The hash is
//! also computed on the host ([`keeps`]) for the reference, so every path drops the same elements.
//!
//! On CUDA, [`dy`] fuses the backward's two products that read the output gradient, and
//! [`expand`] the input gradient's product with its dropout and the gradient registered before;
//! on Hopper, [`linear`] runs a float base layer's product and the update as one GEMM.

#[cfg(feature = "cuda")]
pub mod dy;
#[cfg(feature = "cuda")]
pub mod expand;
#[cfg(feature = "cuda")]
pub mod linear;

/// The CUDA C++ the LoRA kernels share (`mma.cuh`): the MMA, an element's value, the dropout hash.
#[cfg(feature = "cuda")]
const MMA: &str = include_str!("mma.cuh");

use crate::row::elementwise_geometry;
use cubecl::prelude::*;

/// The 32-bit integer finalizer "lowbias32" (C. Wellons' hash prospector): every input bit
/// affects every output bit with near-ideal bias, in five operations.
#[cube]
pub fn mix32(x: u32) -> u32 {
    let mut h = x;
    h ^= h >> 16u32;
    h *= 0x7feb_352du32;
    h ^= h >> 15u32;
    h *= 0x846c_a68bu32;
    h ^= h >> 16u32;
    h
}

/// [`mix32`] on the host.
pub fn mix32_host(x: u32) -> u32 {
    let mut h = x;
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    h ^= h >> 16;
    h
}

/// The per-call mask parameters of one dropout: the element key derived from a 64-bit seed, the
/// 32-bit keep threshold of probability `p` and the scale of kept elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutMask {
    pub key: u32,
    pub threshold: u32,
    pub scale: f32,
}

impl DropoutMask {
    /// The mask of drop probability `p` under `seed`.
    ///
    /// # Panics
    /// If `p` is not in `[0, 1)`.
    pub fn new(p: f64, seed: u64) -> Self {
        assert!((0.0..1.0).contains(&p), "kiln::lora: dropout probability {p} must be in [0, 1)");
        let key = mix32_host((seed as u32) ^ mix32_host((seed >> 32) as u32 ^ 0x9e37_79b9));
        let threshold = (p * 4_294_967_296.0).round().min(u32::MAX as f64) as u32;
        Self { key, threshold, scale: (1.0 / (1.0 - p)) as f32 }
    }

    /// Whether element `i` (row-major index into the `[rows, in]` input) is kept.
    pub fn keeps(&self, i: u32) -> bool {
        mix32_host(i ^ self.key) >= self.threshold
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dropout_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    out: &mut Array<Vector<F, N>>,
    total: usize,
    key: u32,
    threshold: u32,
    scale: f32,
    #[define(F)] _dtype: StorageType,
) {
    let v = ABSOLUTE_POS;
    if v >= total {
        terminate!();
    }
    let x = Vector::<f32, N>::cast_from(x[v]);
    let mut kept = Vector::<f32, N>::empty();
    #[unroll]
    for j in 0..N::value() {
        let i = (v * N::value() + j) as u32;
        kept[j] = select(mix32(i ^ key) >= threshold, x[j] * scale, 0.0f32);
    }
    out[v] = Vector::cast_from(kept);
}

/// Launch `out = dropout(x)` under `mask` over `len` contiguous elements, `vector_size` dividing
/// `len` (< 2³² elements: the hash indexes with u32).
#[allow(clippy::too_many_arguments)]
pub fn launch_dropout<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
    vector_size: usize,
    mask: DropoutMask,
    x: ArrayArg<R>,
    out: ArrayArg<R>,
) {
    assert!(len <= u32::MAX as usize + 1, "kiln::lora: dropout indexes elements with 32 bits; {len} elements");
    let total = len / vector_size;
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: both arrays are contiguous with `len` elements; units past `total` exit.
    unsafe {
        dropout_kernel::launch_unchecked::<R>(client, count, dim, vector_size, x, out, total, mask.key, mask.threshold, mask.scale, dtype)
    }
}
