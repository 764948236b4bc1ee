//! Glue between Burn's `CubeTensor` and the launch functions of `kiln-kernels`.

use burn::tensor::{
    DType, FloatDType, IntDType, Shape,
    ops::{FloatTensorOps, IntTensorOps},
};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement,
    kernel::into_contiguous,
    ops::numeric::empty_device_contiguous_dtype,
    tensor::CubeTensor,
};
use cubecl::prelude::StorageType;

/// A fresh, dense row-major tensor on the device of `like` (never pitched: the kernels index
/// `row * width + col`).
pub(crate) fn empty_like_device<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: impl Into<Shape>,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape.into(), dtype)
}

/// The tensor in dense row-major layout (a no-op when it already is).
///
/// An axis of size 1 may carry any stride, as no index multiplies it: CubeCL's CUDA runtime pads
/// the rows of the 2-D tensors Burn's ops allocate to 512 bytes, so a `[1, 3200]` bf16 activation
/// has row stride 3328, and copying it took ~110 µs of host time a call (H100, `RESULTS.md`
/// 2026-11-26). Such a tensor is relabelled, not copied.
pub(crate) fn dense<R: CubeRuntime>(tensor: CubeTensor<R>) -> CubeTensor<R> {
    if tensor.is_contiguous() || tensor.qparams.is_some() || !dense_but_for_unit_axes(tensor.meta.shape(), tensor.meta.strides()) {
        return into_contiguous(tensor);
    }
    let (shape, handle) = (tensor.meta.shape().clone(), tensor.handle.clone());
    CubeTensor::new_contiguous(tensor.client, tensor.device, shape, handle, tensor.dtype)
}

/// Whether `strides` lay `shape` out densely in row-major order, the strides of axes of size 1
/// aside.
fn dense_but_for_unit_axes(shape: &[usize], strides: &[usize]) -> bool {
    let mut expected = 1;
    for (&size, &stride) in shape.iter().zip(strides).rev() {
        if size != 1 && stride != expected {
            return false;
        }
        expected *= size;
    }
    true
}

/// The tensor with a unit stride on its last axis, other strides left as they are (rotary ops read
/// strided heads directly).
pub(crate) fn unit_last_stride<R: CubeRuntime>(tensor: CubeTensor<R>) -> CubeTensor<R> {
    let rank = tensor.meta.num_dims();
    if tensor.meta.strides()[rank - 1] == 1 {
        tensor
    } else {
        into_contiguous(tensor)
    }
}

/// A dense int tensor in a 32-bit dtype, which kernels read as packed u32 words (a backend with
/// 64-bit ints holds words sign-extended; the cast keeps their low 32 bits).
pub(crate) fn dense_words<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(t: CubeTensor<R>) -> CubeTensor<R> {
    let t = if matches!(t.dtype, DType::I32 | DType::U32) { t } else { CubeBackend::<R, F, I, BT>::int_cast(t, IntDType::I32) };
    dense(t)
}

/// A dense f32 copy of a float tensor (the tensor itself when it already is one).
pub(crate) fn dense_f32<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(t: CubeTensor<R>) -> CubeTensor<R> {
    let t = if t.dtype == DType::F32 { t } else { CubeBackend::<R, F, I, BT>::float_cast(t, FloatDType::F32) };
    dense(t)
}

/// The kernel storage type of a tensor's dtype.
pub(crate) fn storage<R: CubeRuntime>(tensor: &CubeTensor<R>) -> StorageType {
    tensor.dtype.into()
}

/// Element strides of a tensor.
pub(crate) fn strides<R: CubeRuntime>(tensor: &CubeTensor<R>) -> Vec<usize> {
    tensor.meta.strides().iter().copied().collect()
}

/// Reduce a `[partials, width]` f32 buffer of per-cube sums to `[width]` in `dtype`, in one
/// launch (`kiln_kernels::row::launch_sum_partials`).
pub(crate) fn sum_partials<R: CubeRuntime>(partials: CubeTensor<R>, dtype: DType) -> CubeTensor<R> {
    use burn::tensor::TensorMetadata;
    let (rows, width) = (partials.shape()[0], partials.shape()[1]);
    let partials = dense(partials);
    let out = empty_like_device(&partials, [width], dtype);
    kiln_kernels::row::launch_sum_partials(
        &partials.client,
        dtype.into(),
        rows,
        width,
        partials.clone().into_array_arg(),
        out.clone().into_array_arg(),
    );
    out
}

/// What kiln needs to know of a tensor that lives on CubeCL's CUDA runtime.
#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
    use cubecl::{client::ComputeClient, cuda::CudaRuntime};

    /// The CUDA device index of a CubeCL tensor, if it lives on CUDA.
    pub(crate) fn device_index<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<usize> {
        (&t.device as &dyn std::any::Any).downcast_ref::<cubecl::cuda::CudaDevice>().map(|d| d.index)
    }

    /// The tensor's client as CubeCL's CUDA client, if it is one.
    pub(crate) fn client<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<&ComputeClient<CudaRuntime>> {
        (&t.client as &dyn std::any::Any).downcast_ref::<ComputeClient<CudaRuntime>>()
    }

    /// The tensor's buffer as a raw binding, for kernels launched outside CubeCL's launch macros
    /// (CUDA C++ through `kiln_kernels::cuda_source`).
    pub(crate) fn binding<R: CubeRuntime>(t: &CubeTensor<R>) -> cubecl::server::Binding {
        t.handle.clone().binding()
    }

    /// The element kind of kiln's CUDA C++ kernels for `dtype`, if it is one of theirs (f32, f16,
    /// bf16); each kernel's own fit check says which kinds it takes.
    pub(crate) fn float_kind(dtype: burn::tensor::DType) -> Option<kiln_kernels::cuda_source::FloatKind> {
        use burn::tensor::DType;
        use kiln_kernels::cuda_source::FloatKind;
        match dtype {
            DType::F32 => Some(FloatKind::F32),
            DType::F16 => Some(FloatKind::F16),
            DType::BF16 => Some(FloatKind::Bf16),
            _ => None,
        }
    }

    /// Whether `t` lives on a CUDA device of compute capability `minimum` or up.
    pub(crate) fn capable<R: CubeRuntime>(t: &CubeTensor<R>, minimum: (i32, i32)) -> bool {
        device_index(t).and_then(compute_capability).is_some_and(|cc| cc >= minimum)
    }

    /// Compute capability `(major, minor)` of CUDA device `index` (queried once per device; CubeCL
    /// initialized the driver when it created the device's client).
    pub(crate) fn compute_capability(index: usize) -> Option<(i32, i32)> {
        type Capabilities = Mutex<HashMap<usize, Option<(i32, i32)>>>;
        static CACHE: OnceLock<Capabilities> = OnceLock::new();
        let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        *cache.entry(index).or_insert_with(|| {
            use cudarc::driver::{result::device, sys::CUdevice_attribute as A};
            let dev = device::get(index as i32).ok()?;
            // SAFETY: `dev` is a valid device handle from `device::get`; the attributes are plain queries.
            let (major, minor) = unsafe {
                (device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).ok()?, device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).ok()?)
            };
            Some((major, minor))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::dense_but_for_unit_axes;

    #[test]
    fn unit_axes_may_carry_any_stride() {
        // A pitched single row (CUDA pads rows to 512 bytes) is dense; two pitched rows are not.
        assert!(dense_but_for_unit_axes(&[1, 3200], &[3328, 1]));
        assert!(!dense_but_for_unit_axes(&[2, 3200], &[3328, 1]));
        assert!(dense_but_for_unit_axes(&[2, 1, 5], &[5, 99, 1]));
        assert!(dense_but_for_unit_axes(&[2, 3], &[3, 1]));
        // Transposed, or a last axis that skips elements.
        assert!(!dense_but_for_unit_axes(&[3, 2], &[1, 3]));
        assert!(!dense_but_for_unit_axes(&[1, 4], &[8, 2]));
    }
}
