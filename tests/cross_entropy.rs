//! Cross-entropy vs its reference: per-row losses and the logits' gradient, widths that take
//! every vector width, ignored rows, flat and peaked logits, f32/f16; targets past the row.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Int, Tensor, TensorData};
use common::checks::{CrossEntropyCase, assert_cases};

fn cases() -> Vec<CrossEntropyCase> {
    let shapes = [[1, 1], [3, 7], [5, 34], [17, 1000], [4, 5003], [2, 32_000]];
    let scales = [1.0, 8.0];
    let mut out = Vec::new();
    for (i, &[rows, width]) in shapes.iter().enumerate() {
        for (j, &scale) in scales.iter().enumerate() {
            out.push(CrossEntropyCase { rows, width, scale, ignore_every: 3, seed: (2 * i + j) as u64 });
        }
    }
    out
}

#[test]
fn cross_entropy_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases(), &device, &[DType::F32, DType::F16]);
}

#[test]
fn cross_entropy_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

/// Rows with targets 2, 7 (past a row of 7), −100 and −1: a loss, NaN, 0, 0; gradient rows
/// finite, NaN, zero, zero.
fn check_targets_outside<B: kiln::KilnAutodiffBackend>(device: &B::Device) {
    let logits = common::tensor::<B, 2>(&common::random(&[4, 7], 9), DType::F32, device).require_grad();
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![2i64, 7, -100, -1], [4]), device);
    let loss = kiln::ops::cross_entropy(logits.clone(), targets);
    let grads = loss.clone().sum().backward();
    let (loss, grad) = (common::values(loss), common::values(logits.grad(&grads).unwrap()));
    assert!(loss[0].is_finite() && loss[0] > 0.0 && loss[1].is_nan() && loss[2] == 0.0 && loss[3] == 0.0, "{loss:?}");
    assert!(grad[..7].iter().all(|g| g.is_finite()) && grad[7..14].iter().all(|g| g.is_nan()), "{grad:?}");
    assert!(grad[14..].iter().all(|&g| g == 0.0), "{grad:?}");
    // The gradient of a counted row sums to zero (softmax minus one-hot).
    assert!(grad[..7].iter().sum::<f64>().abs() < 1e-6, "{grad:?}");
}

#[test]
fn cross_entropy_marks_targets_outside_the_row() {
    check_targets_outside::<Autodiff<NdArray>>(&Default::default());
    if let Some(device) = common::wgpu_device() {
        check_targets_outside::<Autodiff<burn::backend::Wgpu>>(&device);
    }
}

#[test]
fn cross_entropy_rejects_mismatched_targets() {
    let device = Default::default();
    let logits = Tensor::<NdArray, 2>::ones([2, 8], &device);
    let targets = Tensor::<NdArray, 1, Int>::zeros([3], &device);
    let msg = common::panic_message(|| kiln::ops::cross_entropy(logits, targets));
    assert!(msg.contains("kiln::cross_entropy") && msg.contains("[3]") && msg.contains("[2, 8]"), "{msg}");
    let empty = Tensor::<NdArray, 2>::ones([2, 0], &device);
    let msg = common::panic_message(|| kiln::ops::cross_entropy(empty, Tensor::<NdArray, 1, Int>::zeros([2], &device)));
    assert!(msg.contains("kiln::cross_entropy") && msg.contains("[2, 0]"), "{msg}");
}

