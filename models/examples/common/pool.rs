//! CubeCL's memory pool as the examples report it.

/// CubeCL's pool on a CUDA device (bytes in use, reserved); `None` elsewhere.
#[cfg(feature = "cuda")]
pub fn pool_usage<D: 'static>(device: &D) -> Option<(u64, u64)> {
    let cuda = (device as &dyn std::any::Any).downcast_ref::<burn::backend::cuda::CudaDevice>()?;
    kiln::backend::graph::pool_usage(cuda).ok()
}

#[cfg(not(feature = "cuda"))]
pub fn pool_usage<D>(_device: &D) -> Option<(u64, u64)> {
    None
}

/// `in use … GB, reserved … GB`, or `n/a` off CUDA.
pub fn describe(usage: Option<(u64, u64)>) -> String {
    usage.map_or("n/a".to_string(), |(used, reserved)| format!("in use {:.3} GB, reserved {:.3} GB", used as f64 / 1e9, reserved as f64 / 1e9))
}
