//! The fused linear cross-entropy vs composed Burn ops: the loss and the gradients of the hidden
//! states and the weight, chunked and whole, mean and sum, the weight as given and as a tied
//! embedding's transpose, f32/f16; a frozen weight; ignored rows; bad shapes.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Int, Tensor, TensorData};
use common::checks::{LinearCrossEntropyCase, assert_cases};
use kiln::ops::linear_cross_entropy::{LinearCrossEntropyOptions, Reduction};

fn cases() -> Vec<LinearCrossEntropyCase> {
    let case = |rows, d, vocab, chunk_rows, reduction, tied, seed| LinearCrossEntropyCase { rows, d, vocab, chunk_rows, reduction, tied, ignore_every: 3, seed };
    vec![
        case(1, 8, 5, None, Reduction::Mean, false, 1),
        case(17, 24, 300, Some(5), Reduction::Mean, false, 2),
        case(17, 24, 300, Some(5), Reduction::Sum, true, 3),
        case(40, 64, 1000, Some(16), Reduction::Mean, true, 4),
        case(9, 16, 5003, None, Reduction::Sum, false, 5),
    ]
}

/// On lavapipe the first three cases only (two shapes): every new product shape autotunes Burn's
/// matmul there, and all five took 8.5 minutes of CI's wall time (42nd session, beside other
/// tests). The other two (vocabularies of 1000 and 5003) run on NdArray below; the GPU check's
/// parity runs the op on CUDA.
#[test]
fn linear_cross_entropy_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases()[..3], &device, &[DType::F32, DType::F16]);
}

#[test]
fn linear_cross_entropy_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

/// Chunked or whole, with or without autodiff, a frozen weight or not: the same loss; the frozen
/// weight gets no gradient and the hidden states the same one.
fn check_frozen_weight<B: kiln::KilnAutodiffBackend>(device: &B::Device) {
    let h = common::tensor::<B, 2>(&common::random(&[11, 6], 7), DType::F32, device);
    let w = common::tensor::<B, 2>(&common::random(&[6, 37], 8), DType::F32, device);
    let t = Tensor::<B, 1, Int>::from_data(TensorData::new((0..11).map(|i| if i % 4 == 2 { -100 } else { i * 3 % 37 }).collect::<Vec<i64>>(), [11]), device);
    let options = |chunk_rows| LinearCrossEntropyOptions { reduction: Reduction::Mean, chunk_rows };
    let run = |w: Tensor<B, 2>, chunk_rows| {
        let h = h.clone().require_grad();
        let loss = kiln::ops::linear_cross_entropy(h.clone(), w.clone(), t.clone(), options(chunk_rows));
        let grads = loss.clone().backward();
        (common::values(loss), common::values(h.grad(&grads).unwrap()), w.grad(&grads).map(common::values))
    };
    let (loss, dh, dw) = run(w.clone().require_grad(), None);
    let (frozen_loss, frozen_dh, frozen_dw) = run(w.clone(), Some(4));
    assert!(dw.is_some() && frozen_dw.is_none());
    let plain = common::values(kiln::ops::linear_cross_entropy(h.clone().inner(), w.clone().inner(), t.clone().inner(), options(Some(3))));
    let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()));
    assert!(close(&loss, &frozen_loss) && close(&loss, &plain), "{loss:?} {frozen_loss:?} {plain:?}");
    assert!(close(&dh, &frozen_dh), "{dh:?} {frozen_dh:?}");
}

#[test]
fn linear_cross_entropy_leaves_a_frozen_weight_alone() {
    check_frozen_weight::<Autodiff<NdArray>>(&Default::default());
    if let Some(device) = common::wgpu_device() {
        check_frozen_weight::<Autodiff<burn::backend::Wgpu>>(&device);
    }
}

/// Every row ignored: the mean is 0 and so are the gradients.
#[test]
fn linear_cross_entropy_of_no_counted_row_is_zero() {
    type B = Autodiff<NdArray>;
    let device = Default::default();
    let h = common::tensor::<B, 2>(&common::random(&[3, 4], 1), DType::F32, &device).require_grad();
    let w = common::tensor::<B, 2>(&common::random(&[4, 9], 2), DType::F32, &device).require_grad();
    let t = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![-100i64; 3], [3]), &device);
    let loss = kiln::ops::linear_cross_entropy(h.clone(), w.clone(), t, Default::default());
    let grads = loss.clone().backward();
    assert_eq!(common::values(loss), vec![0.0]);
    assert!(common::values(h.grad(&grads).unwrap()).iter().chain(&common::values(w.grad(&grads).unwrap())).all(|&g| g == 0.0));
}

#[test]
fn linear_cross_entropy_rejects_bad_shapes() {
    let device = Default::default();
    let h = Tensor::<NdArray, 2>::ones([2, 8], &device);
    let t = Tensor::<NdArray, 1, Int>::zeros([2], &device);
    let msg = common::panic_message(|| kiln::ops::linear_cross_entropy(h.clone(), Tensor::<NdArray, 2>::ones([7, 5], &device), t.clone(), Default::default()));
    assert!(msg.contains("kiln::linear_cross_entropy") && msg.contains("[7, 5]") && msg.contains("[2, 8]"), "{msg}");
    let msg = common::panic_message(|| kiln::ops::linear_cross_entropy(h.clone(), Tensor::<NdArray, 2>::ones([8, 5], &device), Tensor::<NdArray, 1, Int>::zeros([3], &device), Default::default()));
    assert!(msg.contains("kiln::linear_cross_entropy") && msg.contains("[3]"), "{msg}");
    let options = LinearCrossEntropyOptions { chunk_rows: Some(0), ..Default::default() };
    let msg = common::panic_message(|| kiln::ops::linear_cross_entropy(h, Tensor::<NdArray, 2>::ones([8, 5], &device), t, options));
    assert!(msg.contains("chunk_rows"), "{msg}");
}

/// Default chunks: 256 MB of logits, whole 64-row tiles, never more rows than there are; a trained
/// weight's chunks at least `TRAINED_CHUNK_ROWS` rows (each chunk past the first adds a pass over
/// `dW`); at least one row whatever the vocabulary.
#[test]
fn linear_cross_entropy_default_chunks() {
    use kiln::ops::linear_cross_entropy::{TRAINED_CHUNK_ROWS, default_chunk_rows};
    // 256 MiB / (128256 × 2 bytes) = 1046.5 rows, cut to 16 tiles of 64.
    assert_eq!(default_chunk_rows(8192, 128_256, 2, false), 1024);
    assert_eq!(default_chunk_rows(8192, 128_256, 2, true), TRAINED_CHUNK_ROWS.max(1024));
    assert_eq!(default_chunk_rows(8192, 32_000, 4, true), 2048);
    // f32 at 152064 classes: 441 rows fit, 384 in tiles; a trained weight takes its floor.
    assert_eq!(default_chunk_rows(8192, 152_064, 4, false), 384);
    assert_eq!(default_chunk_rows(8192, 152_064, 4, true), TRAINED_CHUNK_ROWS);
    assert_eq!(default_chunk_rows(300, 128_256, 2, true), 300);
    assert_eq!(default_chunk_rows(300, 128_256, 2, false), 300);
    assert_eq!(default_chunk_rows(5, 1 << 30, 4, false), 1);
}
