//! Gated linear units on CubeCL backends.

use burn::tensor::{TensorMetadata, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::{row::vector_size_for, swiglu::{launch_backward, launch_forward}};

use super::{GluActivation, SwiGluBackend};
use crate::backend::cube::{dense, empty_like_device, storage};

/// Element count and vector width (16-byte loads where the length allows).
fn plan<R: CubeRuntime>(x: &CubeTensor<R>) -> (usize, usize) {
    let len = x.shape().num_elements();
    (len, vector_size_for(&x.client, len, x.dtype.size(), 16))
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> SwiGluBackend for CubeBackend<R, F, I, BT> {
    fn glu_forward(gate: FloatTensor<Self>, up: FloatTensor<Self>, act: GluActivation) -> FloatTensor<Self> {
        let (gate, up) = (dense(gate), dense(up));
        let (len, vector_size) = plan(&gate);
        let out = empty_like_device(&gate, gate.shape(), gate.dtype);
        launch_forward(
            &gate.client.clone(),
            storage(&gate),
            len,
            vector_size,
            act,
            gate.into_array_arg(),
            up.into_array_arg(),
            out.clone().into_array_arg(),
        );
        out
    }

    fn glu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        act: GluActivation,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (gate, up, dy) = (dense(gate), dense(up), dense(dy));
        let (len, vector_size) = plan(&gate);
        let d_gate = empty_like_device(&gate, gate.shape(), gate.dtype);
        let d_up = empty_like_device(&gate, gate.shape(), gate.dtype);
        launch_backward(
            &gate.client.clone(),
            storage(&gate),
            len,
            vector_size,
            act,
            gate.into_array_arg(),
            up.into_array_arg(),
            dy.into_array_arg(),
            d_gate.clone().into_array_arg(),
            d_up.clone().into_array_arg(),
        );
        (d_gate, d_up)
    }
}
