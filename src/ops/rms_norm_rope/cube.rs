//! The fused QK-norm + RoPE on CubeCL backends.

use burn::tensor::{DType, TensorMetadata, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::{
    rms_norm_rope::{RmsNormRopeBackwardArgs, RmsNormRopeForwardArgs, RmsNormRopePlan, launch_backward, launch_forward},
    rope::rope_vector_size,
};

use super::{RmsNormRopeBackend, RmsNormRopeOutput};
use crate::backend::cube::{dense, empty_like_device, storage, strides, sum_partials, unit_last_stride};

fn plan<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> RmsNormRopePlan {
    let x = tensors[0];
    let head_dim = x.shape()[3];
    let all_strides: Vec<usize> = tensors.iter().flat_map(|t| strides(t)).collect();
    let vector_size = rope_vector_size(&x.client, head_dim, &all_strides, x.dtype.size());
    RmsNormRopePlan::new(&x.client, head_dim, vector_size).unwrap_or_else(|e| {
        panic!("kiln::rms_norm_rope: heads of {} elements exceed the kernel's limit of {}", e.width, e.max)
    })
}

/// Heads in a `[batch, seq, heads, head_dim]` tensor.
fn head_rows<R: CubeRuntime>(x: &CubeTensor<R>) -> usize {
    let s = x.shape();
    s[0] * s[1] * s[2]
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> RmsNormRopeBackend for CubeBackend<R, F, I, BT> {
    fn rms_norm_rope_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        q_gamma: FloatTensor<Self>,
        k_gamma: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
        epsilon: f64,
    ) -> RmsNormRopeOutput<Self> {
        let (q, k) = (unit_last_stride(q), unit_last_stride(k));
        let plan = plan(&[&q, &k]);
        let (q_rows, k_rows) = (head_rows(&q), head_rows(&k));
        let q_out = empty_like_device(&q, q.shape(), q.dtype);
        let k_out = empty_like_device(&k, k.shape(), k.dtype);
        let q_rstd = empty_like_device(&q, [q_rows], DType::F32);
        let k_rstd = empty_like_device(&q, [k_rows], DType::F32);
        launch_forward(
            &q.client.clone(),
            &plan,
            storage(&q),
            q_rows,
            k_rows,
            offset,
            epsilon as f32,
            RmsNormRopeForwardArgs {
                q: q.into_tensor_arg(),
                k: k.into_tensor_arg(),
                q_gamma: dense(q_gamma).into_tensor_arg(),
                k_gamma: dense(k_gamma).into_tensor_arg(),
                cos: dense(cos).into_tensor_arg(),
                sin: dense(sin).into_tensor_arg(),
                q_out: q_out.clone().into_tensor_arg(),
                k_out: k_out.clone().into_tensor_arg(),
                q_rstd: q_rstd.clone().into_tensor_arg(),
                k_rstd: k_rstd.clone().into_tensor_arg(),
            },
        );
        RmsNormRopeOutput { q: q_out, k: k_out, q_rstd, k_rstd }
    }

    fn rms_norm_rope_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (x, dy) = (unit_last_stride(x), dense(dy));
        let plan = plan(&[&x, &dy]);
        let rows = head_rows(&x);
        let head_dim = x.shape()[3];
        let client = x.client.clone();
        let cubes = plan.backward_layout.grid_stride_cubes(&client, rows);
        let dx = empty_like_device(&x, x.shape(), x.dtype);
        let partials = empty_like_device(&x, [plan.backward_layout.partial_rows(cubes), head_dim], DType::F32);
        let gamma_dtype = gamma.dtype;
        launch_backward(
            &client,
            &plan,
            storage(&x),
            rows,
            cubes,
            offset,
            RmsNormRopeBackwardArgs {
                x: x.into_tensor_arg(),
                gamma: dense(gamma).into_tensor_arg(),
                rstd: dense(rstd).into_tensor_arg(),
                dy: dy.into_tensor_arg(),
                cos: dense(cos).into_tensor_arg(),
                sin: dense(sin).into_tensor_arg(),
                dx: dx.clone().into_tensor_arg(),
                dgamma_partials: partials.clone().into_tensor_arg(),
            },
        );
        (dx, sum_partials(partials, gamma_dtype))
    }
}
