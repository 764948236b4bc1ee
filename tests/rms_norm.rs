//! Fused RMSNorm (+ residual) vs its reference: forward and every gradient, ragged shapes,
//! f32 and f16 on wgpu (lavapipe in CI), and through `Autodiff<NdArray>`.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor};
use common::assert_all;
use common::checks::{RmsNormCase, assert_cases, check};

/// Rows × width, ragged against every block size, width 1 to wide.
const SHAPES: &[[usize; 3]] = &[[1, 1, 1], [2, 3, 7], [1, 5, 33], [3, 7, 100], [1, 2, 4096], [2, 3, 1000], [1, 3, 5000], [1, 260, 64]];

fn cases() -> Vec<RmsNormCase> {
    let shapes = SHAPES.iter().enumerate();
    shapes.flat_map(|(i, &shape)| [false, true].map(|residual| RmsNormCase { shape, residual, seed: 100 + i as u64 })).collect()
}


#[test]
fn rms_norm_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases(), &device, &[DType::F32, DType::F16]);
}

#[test]
fn rms_norm_matches_reference_on_wgpu_without_fusion() {
    let Some(device) = common::wgpu_device() else { return };
    type Bare = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
    assert_cases::<Autodiff<Bare>, _>(&cases(), &device, &[DType::F32]);
}

#[test]
fn rms_norm_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

#[test]
fn rms_norm_rejects_mismatched_gamma() {
    let device = Default::default();
    let x = Tensor::<NdArray, 2>::ones([2, 8], &device);
    let gamma = Tensor::<NdArray, 1>::ones([7], &device);
    let msg = common::panic_message(|| kiln::ops::rms_norm(x, gamma, 1e-6));
    assert!(msg.contains("kiln::rms_norm") && msg.contains("[7]") && msg.contains("[2, 8]"), "{msg}");
}

#[test]
fn rms_norm_residual_rejects_mismatched_residual() {
    let device = Default::default();
    let x = Tensor::<NdArray, 2>::ones([2, 8], &device);
    let r = Tensor::<NdArray, 2>::ones([3, 8], &device);
    let gamma = Tensor::<NdArray, 1>::ones([8], &device);
    let msg = common::panic_message(|| kiln::ops::rms_norm_residual(x, r, gamma, 1e-6));
    assert!(msg.contains("kiln::rms_norm_residual") && msg.contains("[3, 8]"), "{msg}");
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]
        #[test]
        fn rms_norm_any_shape(rows in 1usize..40, width in 1usize..300, residual: bool, seed in 0u64..1000) {
            let Some(device) = common::wgpu_device() else { return Ok(()) };
            let case = RmsNormCase { shape: [1, rows, width], residual, seed };
            assert_all(&format!("rms_norm [{rows}, {width}]"), &check::<Autodiff<burn::backend::Wgpu>, _>(&case, &device, DType::F32));
        }
    }
}
