//! SwiGLU, GeGLU and the squared-ReLU GLU vs their references: forward and both gradients, ragged lengths, f32/f16.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor};
use common::checks::{GluCase, assert_cases};
use kiln::ops::swiglu::GluActivation;

const SHAPES: &[[usize; 2]] = &[[1, 1], [3, 7], [5, 33], [17, 300], [4, 1024], [2, 11008]];

fn cases() -> Vec<GluCase> {
    let activations = [GluActivation::Silu, GluActivation::GeluTanh, GluActivation::Relu2];
    let shapes = SHAPES.iter().enumerate();
    shapes.flat_map(|(i, &shape)| activations.map(|activation| GluCase { shape, activation, seed: 3 * i as u64 })).collect()
}


#[test]
fn glu_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases(), &device, &[DType::F32, DType::F16]);
}

#[test]
fn glu_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

#[test]
fn swiglu_rejects_mismatched_shapes() {
    let device = Default::default();
    let g = Tensor::<NdArray, 2>::ones([2, 8], &device);
    let u = Tensor::<NdArray, 2>::ones([2, 9], &device);
    let msg = common::panic_message(|| kiln::ops::swiglu(g, u));
    assert!(msg.contains("kiln::swiglu") && msg.contains("[2, 8]") && msg.contains("[2, 9]"), "{msg}");
    let g = Tensor::<NdArray, 2>::ones([2, 8], &device);
    let u = Tensor::<NdArray, 2>::ones([2, 9], &device);
    let msg = common::panic_message(|| kiln::ops::relu2_glu(g, u));
    assert!(msg.contains("kiln::relu2_glu"), "{msg}");
}
