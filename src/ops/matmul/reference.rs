//! The reference product from Burn's own ops: on CubeCL backends this is Burn's autotuned
//! matmul (the path kiln takes where cuBLASLt is not available), elsewhere the backend's matmul.

use burn::tensor::{Shape, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::{GemmLayout, GemmViews, viewed};

/// [`super::MatmulBackend::gemm`] from Burn's ops: the views taken with reshapes, then [`product`].
pub fn gemm<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    residual: Option<FloatTensor<B>>,
    views: &GemmViews,
) -> FloatTensor<B> {
    let (lhs, rhs, residual) = viewed::<B>(lhs, rhs, residual, views);
    B::float_reshape(product::<B>(lhs, rhs, bias, residual, views.layout, views.scale), views.out.clone())
}

/// `scale · op(lhs) · op(rhs) + bias + residual` for rank-3 operands; transposes are metadata swaps.
pub(super) fn product<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    residual: Option<FloatTensor<B>>,
    layout: GemmLayout,
    scale: f32,
) -> FloatTensor<B> {
    let lhs = if layout.transpose_lhs { B::float_swap_dims(lhs, 1, 2) } else { lhs };
    let rhs = if layout.transpose_rhs { B::float_swap_dims(rhs, 1, 2) } else { rhs };
    let mut out = B::float_matmul(lhs, rhs);
    if scale != 1.0 {
        out = B::float_mul_scalar(out, scale.into());
    }
    if let Some(bias) = bias {
        let n = bias.shape()[0];
        out = B::float_add(out, B::float_reshape(bias, Shape::new([1, 1, n])));
    }
    if let Some(residual) = residual {
        out = B::float_add(out, residual);
    }
    out
}
