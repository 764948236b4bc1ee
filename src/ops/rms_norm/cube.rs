//! RMSNorm on CubeCL backends: shape bookkeeping and allocation around `kiln_kernels::rms_norm`.

use burn::tensor::{DType, TensorMetadata, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::rms_norm::{
    RmsNormBackwardArgs, RmsNormForwardArgs, RmsNormPlan, launch_backward, launch_forward,
};

use super::{RmsNormBackend, RmsNormOutput};
use crate::backend::cube::{dense, empty_like_device, storage};
use crate::ops::rms_norm::reference;

/// `(rows, width)` of a `[.., width]` tensor.
fn rows_width<R: CubeRuntime>(x: &CubeTensor<R>) -> (usize, usize) {
    let shape = x.shape();
    let width = shape[shape.num_dims() - 1];
    (shape.num_elements() / width.max(1), width)
}

fn plan<R: CubeRuntime>(op: &str, x: &CubeTensor<R>, width: usize) -> RmsNormPlan {
    RmsNormPlan::new(&x.client, width, x.dtype.size()).unwrap_or_else(|e| {
        panic!("kiln::{op}: rows of {} elements exceed the kernel's limit of {}", e.width, e.max)
    })
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> RmsNormBackend
    for CubeBackend<R, F, I, BT>
{
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> RmsNormOutput<Self> {
        let (rows, width) = rows_width(&x);
        if width == 0 || rows == 0 {
            return reference::forward::<Self>(x, gamma, residual, epsilon);
        }
        let plan = plan("rms_norm", &x, width);
        let (x, gamma) = (dense(x), dense(gamma));
        let client = x.client.clone();
        let output = empty_like_device(&x, x.shape(), x.dtype);
        let rstd = empty_like_device(&x, [rows], DType::F32);
        let has_residual = residual.is_some();
        let (residual, residual_out) = match residual {
            Some(r) => (dense(r), Some(empty_like_device(&x, x.shape(), x.dtype))),
            None => (x.clone(), None),
        };
        // Without a residual the kernel never writes `residual_out`: it aliases `x` (input 0)
        // instead of a fresh buffer (a fill launch per call, ~8 µs of host time on the H100).
        let residual_out_arg = match &residual_out {
            Some(r) => r.clone().into_array_arg(),
            None => x.as_tensor_alias(0).into_array_arg(),
        };
        launch_forward(
            &client,
            &plan,
            storage(&x),
            rows,
            width,
            epsilon as f32,
            RmsNormForwardArgs {
                x: x.into_array_arg(),
                residual: residual.into_array_arg(),
                gamma: gamma.into_array_arg(),
                y: output.clone().into_array_arg(),
                residual_out: residual_out_arg,
                rstd: rstd.clone().into_array_arg(),
                has_residual,
            },
        );
        RmsNormOutput {
            output,
            residual: residual_out,
            rstd,
        }
    }

    fn rms_norm_backward(
        h: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (rows, width) = rows_width(&h);
        if width == 0 || rows == 0 {
            return reference::backward::<Self>(h, gamma, rstd, dy);
        }
        let plan = plan("rms_norm", &h, width);
        let (h, gamma, rstd, dy) = (dense(h), dense(gamma), dense(rstd), dense(dy));
        let client = h.client.clone();
        let cubes = plan.backward_layout.grid_stride_cubes(&client, rows);
        let dh = empty_like_device(&h, h.shape(), h.dtype);
        let partials = empty_like_device(&h, [plan.backward_layout.partial_rows(cubes), width], DType::F32);
        let gamma_dtype = gamma.dtype;
        launch_backward(
            &client,
            &plan,
            storage(&h),
            rows,
            width,
            cubes,
            RmsNormBackwardArgs {
                h: h.into_array_arg(),
                gamma: gamma.into_array_arg(),
                rstd: rstd.into_array_arg(),
                dy: dy.into_array_arg(),
                dh: dh.clone().into_array_arg(),
                dgamma_partials: partials.clone().into_array_arg(),
            },
        );
        (dh, crate::backend::cube::sum_partials(partials, gamma_dtype))
    }
}
