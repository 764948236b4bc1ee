//! DoRA's rescaling and factored weight norm on CubeCL backends: shape bookkeeping and
//! allocation around `kiln_kernels::dora`.

use burn::tensor::{DType, FloatDType, TensorMetadata, ops::{FloatTensor, FloatTensorOps}};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::dora::{DoraBackwardArgs, DoraBackwardPlan, DoraColumns, DoraNormArgs, DoraNormPlan, launch_backward, launch_forward, launch_norm};
use kiln_kernels::row::vector_size_for;

use super::{DoraBackend, reference};
use crate::backend::cube::{dense, dense_f32, empty_like_device, storage, sum_partials};

/// `(rows, width)` of a `[.., width]` tensor.
fn rows_width<R: CubeRuntime>(u: &CubeTensor<R>) -> (usize, usize) {
    let shape = u.shape();
    let width = shape[shape.num_dims() - 1];
    (shape.num_elements() / width.max(1), width)
}

/// The column inputs, dense, the norm in f32, and the vector width they share with `u`.
fn columns<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    u: &CubeTensor<R>,
    magnitude: CubeTensor<R>,
    norm: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
) -> (DoraColumns<R>, usize) {
    let norm = match norm.dtype {
        DType::F32 => norm,
        _ => CubeBackend::<R, F, I, BT>::float_cast(norm, FloatDType::F32),
    };
    let vector_size = vector_size_for(&u.client, rows_width(u).1, u.dtype.size(), 16);
    let (magnitude, norm) = (dense(magnitude), dense(norm));
    let has_bias = bias.is_some();
    // Without a bias the kernel never reads it: the magnitude stands in for the binding.
    let bias = bias.map(dense).unwrap_or_else(|| magnitude.clone());
    let columns = DoraColumns { magnitude: magnitude.into_array_arg(), norm: norm.into_array_arg(), bias: bias.into_array_arg(), has_bias };
    (columns, vector_size)
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> DoraBackend for CubeBackend<R, F, I, BT> {
    fn dora_forward(u: FloatTensor<Self>, magnitude: FloatTensor<Self>, norm: FloatTensor<Self>, bias: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        let (rows, width) = rows_width(&u);
        if rows == 0 || width == 0 {
            return reference::forward::<Self>(u, magnitude, norm, bias);
        }
        let u = dense(u);
        let (columns, vector_size) = columns::<R, F, I, BT>(&u, magnitude, norm, bias);
        let y = empty_like_device(&u, u.shape(), u.dtype);
        launch_forward(&u.client.clone(), storage(&u), rows, width, vector_size, columns, u.into_array_arg(), y.clone().into_array_arg());
        y
    }

    fn dora_backward(
        u: FloatTensor<Self>,
        magnitude: FloatTensor<Self>,
        norm: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (rows, width) = rows_width(&u);
        if rows == 0 || width == 0 {
            return reference::backward::<Self>(u, magnitude, norm, bias, dy);
        }
        let (u, dy) = (dense(u), dense(dy));
        let m_dtype = magnitude.dtype;
        let (columns, vector_size) = columns::<R, F, I, BT>(&u, magnitude, norm, bias);
        let client = u.client.clone();
        let plan = DoraBackwardPlan::new(&client, rows, width / vector_size);
        let du = empty_like_device(&u, u.shape(), u.dtype);
        let partials = empty_like_device(&u, [plan.partial_rows(), width], DType::F32);
        let args = DoraBackwardArgs {
            u: u.clone().into_array_arg(),
            dy: dy.into_array_arg(),
            du: du.clone().into_array_arg(),
            dm_partials: partials.clone().into_array_arg(),
        };
        launch_backward(&client, storage(&u), plan, rows, width, vector_size, columns, args);
        (du, sum_partials(partials, m_dtype))
    }

    fn dora_norm(weight_norms_sq: FloatTensor<Self>, a_w: FloatTensor<Self>, a: FloatTensor<Self>, b: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        let ([rank, width], outputs) = ([a.shape()[0], a.shape()[1]], b.shape()[0]);
        if a.dtype == DType::F64 || rank * width * outputs == 0 {
            return reference::norm::<Self>(weight_norms_sq, a_w, a, b, scale);
        }
        // One storage dtype for the kernels: `A`'s (the others come cast when they differ).
        let like = |t: CubeTensor<R>| dense(if t.dtype == a.dtype { t } else { Self::float_cast(t, FloatDType::from(a.dtype)) });
        let (a_w, b, a) = (like(a_w), like(b), dense(a));
        let weight_norms_sq = dense_f32::<R, F, I, BT>(weight_norms_sq);
        let client = a.client.clone();
        let plan = DoraNormPlan::new(&client, rank, width, vector_size_for(&client, width, a.dtype.size(), 16));
        let gram = empty_like_device(&a, [rank, rank], DType::F32);
        let norm = empty_like_device(&a, [outputs], DType::F32);
        let args = DoraNormArgs {
            weight_norms_sq: weight_norms_sq.into_array_arg(),
            a_w: a_w.into_array_arg(),
            a: a.clone().into_array_arg(),
            b: b.into_array_arg(),
            gram: gram.clone().into_array_arg(),
            gram_read: gram.into_array_arg(),
            norm: norm.clone().into_array_arg(),
        };
        launch_norm(&client, storage(&a), plan, rank, width, outputs, scale as f32, args);
        norm
    }
}
