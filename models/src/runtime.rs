//! Picks the backend a program runs on: CUDA, else a wgpu GPU, else the CPU (NdArray), as asked
//! and as available, and hands it to a generic task.

use burn::backend::NdArray;
use burn::tensor::Tensor;
use kiln::KilnBackend;

/// A computation to run on whichever backend [`dispatch`] picks.
pub trait OnBackend {
    type Output;
    /// `name` says which backend and device, for the user.
    fn run<B: KilnBackend>(self, device: B::Device, name: &str) -> Self::Output;
}

/// Runs `task` on the backend `choice` names: `auto` (CUDA, else a wgpu GPU, else the CPU),
/// `cuda`, `wgpu` (any adapter, software ones included) or `cpu`.
///
/// # Errors
/// When the asked backend is not compiled in or has no working device, or `choice` is unknown.
pub fn dispatch<T: OnBackend>(choice: &str, task: T) -> Result<T::Output, String> {
    if !matches!(choice, "auto" | "cuda" | "wgpu" | "cpu") {
        return Err(format!("unknown device `{choice}` (auto, cuda, wgpu, cpu)"));
    }
    #[cfg(feature = "cuda")]
    {
        use burn::backend::{Cuda, cuda::CudaDevice};
        let device = CudaDevice::default();
        if matches!(choice, "auto" | "cuda") && works(|| Tensor::<Cuda, 1>::ones([1], &device).into_data()) {
            return Ok(task.run::<Cuda>(device, "CUDA device 0 (kiln CUDA kernels)"));
        }
    }
    if choice == "cuda" {
        return Err("--device cuda: no CUDA device works (or built without the `cuda` feature)".into());
    }
    #[cfg(feature = "wgpu")]
    {
        use burn::backend::{Wgpu, wgpu::WgpuDevice};
        // `auto` takes a real GPU only; `wgpu` also accepts a software adapter (lavapipe).
        let candidates = match choice {
            "auto" => vec![WgpuDevice::DiscreteGpu(0), WgpuDevice::IntegratedGpu(0)],
            "wgpu" => vec![WgpuDevice::DefaultDevice],
            _ => vec![],
        };
        for device in candidates {
            if works(|| Tensor::<Wgpu, 1>::ones([1], &device).into_data()) {
                let name = format!("wgpu {device:?} (kiln CubeCL kernels)");
                return Ok(task.run::<Wgpu>(device, &name));
            }
        }
    }
    if choice == "wgpu" {
        return Err("--device wgpu: no wgpu adapter works (or built without the `wgpu` feature)".into());
    }
    Ok(task.run::<NdArray>(Default::default(), "the CPU with NdArray (kiln reference ops)"))
}

/// Whether `f` completes without panicking (device probes panic when no device exists).
fn works<T>(f: impl FnOnce() -> T) -> bool {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_ok();
    std::panic::set_hook(hook);
    ok
}
