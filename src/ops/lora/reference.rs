//! LoRA from plain Burn ops: Burn's matmul for the products and the dropout mask built on the host
//! from the same hash as the kernel (`kiln_kernels::lora::DropoutMask::keeps`).

use burn::tensor::{FloatDType, TensorData, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::products::{self, Kernels};
use super::{DropoutMask, LoraGrads, LoraLinearGrads, LoraSpec};
use crate::ops::compute_dtype;

/// `x · keep(i) / (1 − p)` elementwise, in f32 (f64 for f64), stored in `x`'s dtype.
pub fn dropout<B: Backend>(x: FloatTensor<B>, mask: DropoutMask) -> FloatTensor<B> {
    let (shape, dtype) = (x.shape(), x.dtype());
    let factors: Vec<f32> = (0..shape.num_elements()).map(|i| if mask.keeps(i as u32) { mask.scale } else { 0.0 }).collect();
    let work = compute_dtype(dtype);
    let factors = B::float_cast(B::float_from_data(TensorData::new(factors, shape), &B::float_device(&x)), work);
    B::float_cast(B::float_mul(B::float_cast(x, work), factors), FloatDType::from(dtype))
}

/// `(y, h)` of [`super::LoraBackend::lora_forward`].
pub fn forward<B: Backend>(x: FloatTensor<B>, base: FloatTensor<B>, a: FloatTensor<B>, b: FloatTensor<B>, spec: LoraSpec) -> (FloatTensor<B>, FloatTensor<B>) {
    products::forward(&Kernels::<B>::reference(), x, base, a, b, spec)
}

/// The gradients of [`super::LoraBackend::lora_backward`].
#[allow(clippy::too_many_arguments)]
pub fn backward<B: Backend>(
    x: FloatTensor<B>,
    h: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    dy: FloatTensor<B>,
    spec: LoraSpec,
    prior: Option<FloatTensor<B>>,
) -> LoraGrads<FloatTensor<B>> {
    products::backward(&Kernels::<B>::reference(), x, h, a, b, dy, spec, prior)
}

/// `(y, hs)` of [`super::LoraBackend::lora_linear_forward`].
pub fn linear_forward<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    spec: LoraSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    products::linear_forward(&Kernels::<B>::reference(), x, w, bias, a, b, spec)
}

/// The gradients of [`super::LoraBackend::lora_linear_backward`], `dx` included.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<B: Backend>(
    x: FloatTensor<B>,
    hs: FloatTensor<B>,
    w: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    dy: FloatTensor<B>,
    spec: LoraSpec,
    prior: Option<FloatTensor<B>>,
) -> LoraLinearGrads<FloatTensor<B>> {
    products::linear_backward(&Kernels::<B>::reference(), x, hs, w, a, b, dy, spec, prior, true)
}
