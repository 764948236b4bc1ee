//! LoRA on CubeCL backends: the products through the backend's GEMM (the trait's defaults), the
//! dropout as one elementwise kernel.

use burn::tensor::{TensorMetadata, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use kiln_kernels::{lora::launch_dropout, row::vector_size_for};

use super::{DropoutMask, LoraBackend};
use crate::backend::cube::{dense, empty_like_device, storage};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> LoraBackend for CubeBackend<R, F, I, BT> {
    fn lora_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        // Row-major element order is what the mask hashes, so strided views are made dense first.
        let x = dense(x);
        let len = x.shape().num_elements();
        let vector_size = vector_size_for(&x.client, len, x.dtype.size(), 16);
        let out = empty_like_device(&x, x.shape(), x.dtype);
        launch_dropout(&x.client.clone(), storage(&x), len, vector_size, mask, x.into_array_arg(), out.clone().into_array_arg());
        out
    }
}
