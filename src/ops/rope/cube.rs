//! RoPE on CubeCL backends.

use burn::tensor::{TensorMetadata, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::rope::{launch_rope, rope_vector_size};

use super::RopeBackend;
use crate::backend::cube::{dense, empty_like_device, storage, strides, unit_last_stride};

/// `[batch, seq, heads, head_dim]` of a rank-4 tensor.
pub(crate) fn dims4<R: CubeRuntime>(x: &CubeTensor<R>) -> [usize; 4] {
    let s = x.shape();
    [s[0], s[1], s[2], s[3]]
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> RopeBackend for CubeBackend<R, F, I, BT> {
    fn rope_forward(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
        inverse: bool,
    ) -> FloatTensor<Self> {
        let x = unit_last_stride(x);
        let shape = dims4(&x);
        let vector_size = rope_vector_size(&x.client, shape[3], &strides(&x), x.dtype.size());
        let out = empty_like_device(&x, x.shape(), x.dtype);
        launch_rope(
            &x.client.clone(),
            storage(&x),
            shape,
            vector_size,
            x.into_tensor_arg(),
            dense(cos).into_tensor_arg(),
            dense(sin).into_tensor_arg(),
            out.clone().into_tensor_arg(),
            offset,
            inverse,
        );
        out
    }
}
