//! BitNet b1.58 ternary weights (W2A8): the kernels (wgpu on lavapipe) and the reference
//! (NdArray) against the host definition, exact on the integer paths; the straight-through
//! gradients; the layers (QAT training, packing for inference, records); named errors.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::{DType, Tensor, TensorData};
use common::ternary::{Shape, check_gradients, check_kernels, check_normed, shape};
use kiln::nn::{BitLinear, BitLinearConfig, LinearLayer, TernaryLinear};
use kiln::ops::ternary::{TernaryLayout, TernaryMatrix, TernaryWeight, bitlinear, bitlinear_normed, ternary_matmul};

/// GEMV rows (1, 3, 8: the kernel's limit) and GEMM rows (17), ragged `k` (not a multiple of 16,
/// 64 or 128), odd `n`, per-tensor, per-channel and ragged groups.
const SHAPES: [Shape; 5] = [shape(1, 33, 70, 33), shape(3, 64, 128, 16), shape(8, 17, 300, 1), shape(17, 40, 65, 40), shape(5, 21, 1000, 8)];
const GRAD_SHAPES: [Shape; 3] = [shape(3, 24, 70, 24), shape(17, 9, 130, 2), shape(2, 5, 33, 1)];
/// The input norm inside the quantization: a GEMV shape (the norm's own kernel first) and GEMM
/// shapes (the norm in the activation kernel), ragged `k`.
const NORM_SHAPES: [Shape; 3] = [shape(3, 24, 70, 24), shape(17, 9, 130, 2), shape(33, 16, 200, 16)];

#[test]
fn kernels_agree_with_host_format_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    check_kernels::<burn::backend::Wgpu>(&device, DType::F32, &SHAPES);
    check_kernels::<burn::backend::Wgpu>(&device, DType::F16, &SHAPES[..4]);
}

#[test]
fn reference_agrees_with_host_format_on_ndarray() {
    check_kernels::<NdArray>(&Default::default(), DType::F32, &SHAPES);
}

#[test]
fn straight_through_gradients_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    check_gradients::<Autodiff<burn::backend::Wgpu>>(&device, DType::F32, 0.0, &GRAD_SHAPES);
    check_gradients::<Autodiff<burn::backend::Wgpu>>(&device, DType::F16, 0.0, &GRAD_SHAPES[..2]);
}

#[test]
fn straight_through_gradients_on_ndarray() {
    check_gradients::<Autodiff<NdArray>>(&Default::default(), DType::F32, 0.0, &GRAD_SHAPES);
}

#[test]
fn input_norm_inside_quantization_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    check_normed::<Autodiff<burn::backend::Wgpu>>(&device, DType::F32, 0.0, &NORM_SHAPES);
    check_normed::<Autodiff<burn::backend::Wgpu>>(&device, DType::F16, 0.0, &NORM_SHAPES[1..]);
}

#[test]
fn input_norm_inside_quantization_on_ndarray() {
    check_normed::<Autodiff<NdArray>>(&Default::default(), DType::F32, 0.0, &NORM_SHAPES);
}

/// A teacher with ternary weights and a student `BitLinear` (no input norm) starting from noise:
/// QAT drives the loss down, the packed layer then computes exactly what the trained layer's
/// forward computes, and its record round-trips.
#[test]
fn bitlinear_trains_packs_and_saves() {
    type B = Autodiff<NdArray>;
    let device = Default::default();
    let (d_in, d_out, batch) = (48, 12, 32);
    let teacher = TernaryMatrix::quantize(&common::random(&[d_out, d_in], 1).convert::<f32>().into_vec::<f32>().unwrap(), TernaryLayout::new(d_out, d_in, d_out).unwrap()).unwrap();
    let teacher = TernaryWeight::<NdArray>::from_host(&teacher, &device);
    let config = BitLinearConfig::new(d_in, d_out).with_input_norm(false).with_bias(true);
    let mut layer: BitLinear<B> = config.init(&device);
    let mut optim = AdamConfig::new().init();
    let loss_at = |layer: &BitLinear<B>, step: u64| {
        let x: Tensor<NdArray, 2> = Tensor::from_data(common::random(&[batch, d_in], 1000 + step).convert::<f32>(), &device);
        let target = ternary_matmul(x.clone(), &teacher);
        let y = layer.forward(Tensor::<B, 2>::from_inner(x));
        (y - Tensor::from_inner(target)).powi_scalar(2).mean()
    };
    let first = loss_at(&layer, 0).into_scalar();
    for step in 0..150 {
        let loss = loss_at(&layer, step % 8);
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        layer = optim.step(2e-2, layer, grads);
    }
    let last = loss_at(&layer, 0).into_scalar();
    assert!(last < 0.1 * first, "QAT loss {first} -> {last}");

    let inference = layer.valid();
    let packed = inference.to_ternary();
    let x: Tensor<NdArray, 3> = Tensor::from_data(common::random(&[2, 3, d_in], 7).convert::<f32>(), &device);
    let qat: Vec<f32> = inference.forward(x.clone()).into_data().into_vec().unwrap();
    let ours: Vec<f32> = packed.forward(x.clone()).into_data().into_vec().unwrap();
    assert_eq!(qat, ours, "the packed layer computes the QAT forward");
    assert_eq!(packed.weight_bytes(), 4 * d_out * 64 / 16 + 4);

    let bytes = NamedMpkBytesRecorder::<FullPrecisionSettings>::new().record(packed.clone().into_record(), ()).unwrap();
    let record = NamedMpkBytesRecorder::<FullPrecisionSettings>::new().load(bytes, &device).unwrap();
    let loaded = packed.clone().load_record(record);
    let again: Vec<f32> = loaded.forward(x).into_data().into_vec().unwrap();
    assert_eq!(again, ours, "record round trip");
    assert_eq!(LinearLayer::dense_weight(&packed, DType::F32).dims(), [d_in, d_out]);
}

/// The packed layer is frozen: training a model around it leaves it without gradients.
#[test]
fn ternary_linear_takes_no_gradient() {
    type B = Autodiff<NdArray>;
    let device = Default::default();
    let layer: TernaryLinear<B> = BitLinearConfig::new(16, 8).with_bias(true).init::<B>(&device).to_ternary();
    let x: Tensor<B, 2> = Tensor::from_data(common::random(&[3, 16], 3).convert::<f32>(), &device).require_grad();
    let grads = layer.forward(x.clone()).sum().backward();
    assert!(x.grad(&grads).is_some());
    assert!(layer.scales.val().grad(&grads).is_none() && layer.bias.as_ref().unwrap().val().grad(&grads).is_none());
}

#[test]
fn bad_inputs_are_named() {
    let device = Default::default();
    let w: Tensor<NdArray, 2> = Tensor::from_data(TensorData::new(vec![0.5f32; 12], [3, 4]), &device);
    let msg = common::panic_message(|| TernaryWeight::quantize(w.clone(), 4));
    assert!(msg.contains("groups of 4 rows"), "{msg}");
    let weight = TernaryWeight::quantize(w.clone(), 3);
    let x: Tensor<NdArray, 2> = Tensor::zeros([2, 5], &device);
    let msg = common::panic_message(|| ternary_matmul(x.clone(), &weight));
    assert!(msg.contains("ternary_matmul") && msg.contains("[2, 5]") && msg.contains("[3, 4]"), "{msg}");
    let msg = common::panic_message(|| bitlinear(x.clone(), w.clone(), 3));
    assert!(msg.contains("bitlinear"), "{msg}");
    let x: Tensor<NdArray, 2> = Tensor::zeros([2, 4], &device);
    let msg = common::panic_message(|| bitlinear_normed(x, Tensor::ones([5], &device), 1e-6, w, 3));
    assert!(msg.contains("bitlinear_normed") && msg.contains("gamma has shape [5]") && msg.contains("[4]"), "{msg}");
    assert!(TernaryMatrix::from_hf(&[0xff; 4], 4, 4, 1.0).unwrap_err().0.contains("code 3"));
    assert!(TernaryMatrix::from_hf(&[0; 3], 4, 4, 1.0).unwrap_err().0.contains("HF packed weight has 3"));
}
