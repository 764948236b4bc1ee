//! Parity harness shared by the CI tests (wgpu on lavapipe, NdArray) and the GPU check binary
//! (CUDA): each check runs an op through kiln and through the reference path on the same backend
//! and dtype, compares both against an f64 oracle (the reference on `NdArray<f64>`), and applies
//! DEVELOPERS.md's rule: kernel error ≤ 2 × reference error + a rounding term.

#![allow(dead_code)]

pub mod adapters;
pub mod checks;
pub mod sketches;
pub mod ternary;
pub mod trits;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor, TensorData, backend::Backend};

/// The oracle backend: the reference implementations computing in f64.
pub type Oracle = Autodiff<NdArray<f64>>;

/// Unit roundoff of a storage dtype.
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-24),
    }
}

/// Random normal host values (never zeros), seeded.
pub fn random(shape: &[usize], seed: u64) -> TensorData {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let values: Vec<f64> = (0..n)
        .map(|_| {
            // Box-Muller from two uniforms: N(0, 1).
            let (u1, u2): (f64, f64) = (rng.random_range(1e-12..1.0), rng.random());
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        })
        .collect();
    TensorData::new(values, shape.to_vec())
}

/// A tensor of `data` on `device` stored in `dtype`.
pub fn tensor<B: Backend, const D: usize>(data: &TensorData, dtype: DType, device: &B::Device) -> Tensor<B, D> {
    Tensor::from_data(data.clone().convert_dtype(dtype), (device, dtype))
}

/// Host f64 copy of a tensor.
pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data().convert::<f64>().to_vec::<f64>().expect("f64 data")
}

/// Fill the device's memory pool with NaN so that a kernel output element nobody writes reads
/// back as NaN (outputs are allocated uninitialized from the pool).
pub fn poison<B: Backend>(device: &B::Device, elements: usize, dtype: DType) {
    let poisoned: Tensor<B, 1> = Tensor::full([elements.max(1)], f32::NAN, (device, dtype));
    let _ = poisoned.into_data();
}

/// One compared output.
#[derive(Debug)]
pub struct Comparison {
    pub name: String,
    pub kernel_err: f64,
    pub reference_err: f64,
    pub bound: f64,
    pub scale: f64,
}

impl Comparison {
    pub fn passed(&self) -> bool {
        self.kernel_err.is_finite() && self.kernel_err <= self.bound
    }
}

/// Compare kernel and reference outputs against the oracle for one named output.
pub fn compare(name: &str, kernel: &[f64], reference: &[f64], oracle: &[f64], dtype: DType, depth: f64) -> Comparison {
    assert_eq!(kernel.len(), oracle.len(), "{name}: kernel output has {} elements, oracle {}", kernel.len(), oracle.len());
    assert_eq!(reference.len(), oracle.len(), "{name}: reference output length");
    let max_err = |v: &[f64]| {
        v.iter().zip(oracle).map(|(a, b)| if a.is_nan() { f64::INFINITY } else { (a - b).abs() }).fold(0.0, f64::max)
    };
    let scale = oracle.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let (kernel_err, reference_err) = (max_err(kernel), max_err(reference));
    // Rounding term: a few units in the last place of the output's magnitude, growing with the
    // length of the reductions behind each element (`depth`).
    let rounding = 4.0 * unit_roundoff(dtype) * scale.max(1.0) * depth.max(1.0).sqrt();
    Comparison { name: name.to_string(), kernel_err, reference_err, bound: 2.0 * reference_err + rounding, scale }
}

/// Assert every comparison passed, listing them all on failure.
#[track_caller]
pub fn assert_all(context: &str, comparisons: &[Comparison]) {
    if comparisons.iter().any(|c| !c.passed()) {
        panic!("{context}: parity failed\n{comparisons:#?}");
    }
}

/// The wgpu device for kernel tests, or `None` (test skipped) when no adapter exists. Under
/// `CI=true` a missing adapter fails the test instead.
#[cfg(feature = "wgpu")]
pub fn wgpu_device() -> Option<burn::backend::wgpu::WgpuDevice> {
    let device = burn::backend::wgpu::WgpuDevice::default();
    let probe = std::panic::catch_unwind(|| {
        let t: Tensor<burn::backend::Wgpu, 1> = Tensor::ones([4], &device);
        t.into_data()
    });
    match probe {
        Ok(_) => Some(device),
        Err(_) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("no wgpu adapter found and CI=true: install mesa-vulkan-drivers (lavapipe)")
        }
        Err(_) => {
            eprintln!("no wgpu adapter: kernel test skipped (set CI=true to make this fail)");
            None
        }
    }
}

/// The message of the panic `f` raises (fails if it returns normally).
pub fn panic_message<T>(f: impl FnOnce() -> T) -> String {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(_) => panic!("expected the call to panic"),
        Err(e) => e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
    }
}
