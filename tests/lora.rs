//! LoRA: the op (forward and every gradient, with and without dropout) and the whole layer over a
//! float base in one op (`lora_linear`, its base's gradients too where it trains) or a frozen
//! 4-bit base (`lora_linear_4bit`) against the formula in plain Burn ops; the dropout kernel
//! against its host mask, bit for bit; `LoraLinear` over float and 4-bit bases (starts equal to
//! its base, frozen base, merge/unmerge, training touches only the adapter).

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{DType, Tensor, backend::Backend};
use common::adapters::{LoraCase, LoraLinearCase};
use common::checks::assert_cases;
use kiln::nn::{LinearConfig, LinearLayer, LoraConfig, LoraLinear, Nf4Linear};
use kiln::ops::lora::{DropoutMask, LoraSpec, lora, lora_dropout, lora_linear, lora_linear_4bit};
use kiln::ops::nf4::{QuantType, Quantized4};

fn cases() -> Vec<LoraCase> {
    let case = |batch, m, d_in, d_out, rank, dropout, seed| LoraCase { batch, m, d_in, d_out, rank, scale: 2.0, dropout, seed };
    vec![
        case(1, 1, 16, 8, 1, 0.0, 1),
        case(2, 3, 33, 17, 8, 0.0, 2),
        case(1, 17, 64, 96, 8, 0.25, 3),
        case(3, 5, 130, 70, 64, 0.0, 4),
        case(2, 33, 96, 40, 16, 0.1, 5),
        case(1, 129, 48, 24, 4, 0.5, 6),
    ]
}

/// On lavapipe every new product shape is autotuned, so wgpu checks a subset: ragged shapes, rank
/// 64, dropout, f16.
#[test]
fn lora_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    let cases = cases();
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases[1..5], &device, &[DType::F32]);
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&[cases[2]], &device, &[DType::F16]);
}

#[test]
fn lora_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

fn linear_cases() -> Vec<LoraLinearCase> {
    let case = LoraLinearCase::new;
    vec![
        case(1, 1, 16, 8, 1, 11),
        LoraLinearCase { bias: true, transposed: true, prior: true, base_grad: true, ..case(2, 3, 33, 17, 8, 12) },
        LoraLinearCase { dropout: 0.25, bias: true, ..case(1, 17, 64, 96, 8, 13) },
        LoraLinearCase { transposed: true, x_grad: false, ..case(3, 5, 130, 70, 64, 14) },
        LoraLinearCase { dropout: 0.1, bias: true, base_grad: true, ..case(2, 33, 96, 40, 16, 15) },
        LoraLinearCase { dropout: 0.5, transposed: true, x_grad: false, base_grad: true, ..case(1, 129, 48, 24, 4, 16) },
    ]
}

#[test]
fn lora_linear_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&linear_cases(), &Default::default(), &[DType::F32]);
}

/// wgpu's subset: a transposed trained base with bias, dropout, an untracked input, and f16.
#[test]
fn lora_linear_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    let cases = linear_cases();
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases[1..4], &device, &[DType::F32]);
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&[cases[2]], &device, &[DType::F16]);
}

/// A 4-bit base: ragged shapes whose weight has an odd row length (a partial last block), eight
/// rows or fewer (the backends' 4-bit GEMV, the update added to it) and more (the dequantized
/// weight through the float layer's products), dropout, a prior, a tracked bias, FP4, rank 64.
fn linear_4bit_cases() -> Vec<LoraLinearCase> {
    let case = |batch, m, d_in, d_out, rank, seed| LoraLinearCase { packed: Some(QuantType::Nf4), ..LoraLinearCase::new(batch, m, d_in, d_out, rank, seed) };
    vec![
        LoraLinearCase { bias: true, prior: true, ..case(2, 3, 33, 18, 8, 21) },
        LoraLinearCase { dropout: 0.25, bias: true, base_grad: true, ..case(1, 17, 64, 96, 8, 22) },
        LoraLinearCase { packed: Some(QuantType::Fp4), x_grad: false, ..case(3, 5, 130, 70, 64, 23) },
        LoraLinearCase { dropout: 0.1, prior: true, ..case(2, 33, 96, 40, 1, 24) },
        case(1, 1, 200, 24, 16, 25),
    ]
}

#[test]
fn lora_linear_4bit_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&linear_4bit_cases(), &Default::default(), &[DType::F32]);
}

/// wgpu's subset: the GEMV's few rows with a prior and bias, the dequantized path with dropout and
/// a trained bias, FP4, and f16.
#[test]
fn lora_linear_4bit_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    let cases = linear_4bit_cases();
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases[..3], &device, &[DType::F32]);
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases[..2], &device, &[DType::F16]);
}

#[test]
fn dropout_kernel_drops_the_host_masks_elements() {
    let Some(device) = common::wgpu_device() else { return };
    let shape = [7, 1001];
    let data = common::random(&shape, 11);
    for (p, seed) in [(0.1, 0u64), (0.3, 42), (0.5, u64::MAX)] {
        let mask = DropoutMask::new(p, seed);
        let kernel = common::values(lora_dropout(common::tensor::<burn::backend::Wgpu, 2>(&data, DType::F32, &device), mask));
        let host = common::values(lora_dropout(common::tensor::<NdArray, 2>(&data, DType::F32, &Default::default()), mask));
        // Equal as numbers: the kernel writes +0 where the host's `x · 0` gives -0 for negative x.
        let differ = kernel.iter().zip(&host).filter(|(k, h)| k != h).count();
        assert_eq!(differ, 0, "p {p} seed {seed}: {differ} of {} elements differ", host.len());
        let dropped = kernel.iter().filter(|&&v| v == 0.0).count() as f64 / kernel.len() as f64;
        assert!((dropped - p).abs() < 0.02, "p {p}: dropped {dropped}");
    }
}

#[test]
fn dropout_masks_differ_by_seed_and_match_their_probability() {
    let n = 1 << 20;
    let kept = |mask: DropoutMask| (0..n).filter(|&i| mask.keeps(i)).count() as f64 / n as f64;
    assert!((kept(DropoutMask::new(0.3, 7)) - 0.7).abs() < 0.002);
    let (a, b) = (DropoutMask::new(0.5, 1), DropoutMask::new(0.5, 2));
    let same = (0..n).filter(|&i| a.keeps(i) == b.keeps(i)).count() as f64 / n as f64;
    assert!((same - 0.5).abs() < 0.005, "masks of two seeds agree on {same} of elements");
    assert!((0..n).all(|i| DropoutMask::new(0.0, 9).keeps(i)));
}

#[test]
fn lora_rejects_bad_shapes() {
    let device = Default::default();
    let x = Tensor::<NdArray, 2>::ones([3, 16], &device);
    let base = Tensor::<NdArray, 2>::ones([3, 8], &device);
    let a = Tensor::<NdArray, 2>::ones([4, 15], &device);
    let b = Tensor::<NdArray, 2>::ones([8, 4], &device);
    let spec = LoraSpec { scale: 1.0, dropout: None };
    let msg = common::panic_message(|| lora(x, base, a, b, spec));
    assert!(msg.contains("kiln::lora") && msg.contains("[4, 15]") && msg.contains("[3, 16]"), "{msg}");
    let msg = common::panic_message(|| DropoutMask::new(1.0, 0));
    assert!(msg.contains("dropout probability 1"), "{msg}");
}

#[test]
fn lora_linear_rejects_bad_shapes() {
    let device = Default::default();
    let ones = |shape: [usize; 2]| Tensor::<NdArray, 2>::ones(shape, &device);
    let spec = LoraSpec { scale: 1.0, dropout: None };
    let msg = common::panic_message(|| lora_linear(ones([3, 16]), ones([15, 8]), None, ones([4, 16]), ones([8, 4]), spec));
    assert!(msg.contains("kiln::lora_linear") && msg.contains("[15, 8]") && msg.contains("[3, 16]"), "{msg}");
    let msg = common::panic_message(|| lora_linear(ones([3, 16]), ones([16, 8]), None, ones([4, 16]), ones([9, 4]), spec));
    assert!(msg.contains("kiln::lora_linear") && msg.contains("[9, 4]"), "{msg}");
    let bias = Tensor::<NdArray, 1>::ones([7], &device);
    let msg = common::panic_message(|| lora_linear(ones([3, 16]), ones([16, 8]), Some(bias.clone()), ones([4, 16]), ones([8, 4]), spec));
    assert!(msg.contains("kiln::lora_linear") && msg.contains("bias [7]"), "{msg}");
    let packed = Quantized4::<NdArray>::quantize(ones([8, 16]), QuantType::Nf4, 64, false);
    let msg = common::panic_message(|| lora_linear_4bit(ones([3, 15]), &packed, None, ones([4, 16]), ones([8, 4]), spec));
    assert!(msg.contains("kiln::lora_linear_4bit") && msg.contains("[3, 15]") && msg.contains("[8, 16]"), "{msg}");
    let msg = common::panic_message(|| lora_linear_4bit(ones([3, 16]), &packed, Some(bias), ones([4, 16]), ones([8, 4]), spec));
    assert!(msg.contains("kiln::lora_linear_4bit") && msg.contains("bias [7]"), "{msg}");
    let msg = common::panic_message(|| lora_linear_4bit(ones([3, 16]), &packed, None, ones([4, 16]), ones([8, 4]).cast(DType::F64), spec));
    assert!(msg.contains("kiln::lora_linear_4bit") && msg.contains("b: F64"), "{msg}");
}

type Ad = Autodiff<NdArray>;

fn linear(d_in: usize, d_out: usize) -> kiln::nn::Linear<Ad> {
    LinearConfig::new(d_in, d_out).init(&Default::default())
}

fn input(rows: usize, d_in: usize, seed: u64) -> Tensor<Ad, 2> {
    common::tensor(&common::random(&[rows, d_in], seed), DType::F32, &Default::default())
}

fn max_diff<B: Backend>(a: Tensor<B, 2>, b: Tensor<B, 2>) -> f64 {
    let (a, b) = (common::values(a), common::values(b));
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// A LoRA layer whose `B` is random (a fresh one is zero, which would hide the update).
fn adapted(base: kiln::nn::Linear<Ad>, config: &LoraConfig) -> LoraLinear<Ad, kiln::nn::Linear<Ad>> {
    let mut layer = config.init(base, &Default::default());
    let adapter = layer.adapter.as_mut().unwrap();
    let [d_out, r] = adapter.lora_b.dims();
    adapter.lora_b = burn::module::Param::from_tensor(input(d_out, r, 99));
    layer
}

#[test]
fn fresh_adapter_starts_equal_to_its_base_and_trains_only_itself() {
    let base = linear(24, 12);
    let x = input(5, 24, 1);
    let expected = base.forward(x.clone());
    let config = LoraConfig::new().with_rank(4).with_alpha(16.0).with_dropout(0.1);
    let layer = config.init(base, &Default::default());
    assert_eq!(max_diff(LinearLayer::forward(&layer.valid(), x.clone().inner()), expected.clone().inner()), 0.0);

    let weight_before = layer.base.weight.val().into_data();
    let mut layer = layer;
    let mut optimizer = AdamWConfig::new().init();
    for step in 0..3 {
        let loss = LinearLayer::forward(&layer, input(5, 24, 10 + step)).powi_scalar(2).mean();
        let grads = loss.backward();
        assert!(layer.base.weight.grad(&grads).is_none(), "the frozen base got a gradient");
        let grads = GradientsParams::from_grads(grads, &layer);
        assert_eq!(grads.len(), 2, "only lora_A and lora_B take gradients");
        layer = optimizer.step(1e-2, layer, grads);
    }
    assert_eq!(layer.base.weight.val().into_data(), weight_before, "training changed the base weight");
    let adapter = layer.adapter.as_ref().unwrap();
    assert!(adapter.lora_b.val().abs().max().into_scalar() > 0.0, "lora_B did not train");
}

#[test]
fn merge_and_unmerge_round_trip() {
    let config = LoraConfig::new().with_rank(8).with_alpha(4.0).with_rslora(true);
    let mut layer = adapted(linear(40, 20), &config).valid();
    let x = input(7, 40, 3).inner();
    let unmerged = LinearLayer::forward(&layer, x.clone());
    let original = layer.base.weight.val();
    layer.merge();
    assert!(layer.merged);
    assert!(max_diff(LinearLayer::forward(&layer, x.clone()), unmerged.clone()) < 1e-4);
    assert!(max_diff(layer.base.weight.val(), original.clone()) > 1e-3, "merge changed nothing");
    layer.unmerge();
    assert!(max_diff(layer.base.weight.val(), original) < 1e-5);
    assert!(max_diff(LinearLayer::forward(&layer, x.clone()), unmerged.clone()) < 1e-4);
    let merged = layer.merge_and_unload();
    assert!(max_diff(merged.forward(x), unmerged) < 1e-4);
}

#[test]
fn qlora_layer_adds_the_update_to_the_4bit_base() {
    let device = Default::default();
    let float = linear(128, 48);
    let base = Nf4Linear::from_linear(&float, QuantType::Nf4, 64, true);
    let config = LoraConfig::new().with_rank(8).with_alpha(16.0);
    let mut layer = config.init(base, &device);
    let adapter = layer.adapter.as_mut().unwrap();
    adapter.lora_b = burn::module::Param::from_tensor(input(48, 8, 5));
    let x = input(9, 128, 6);
    let y = LinearLayer::forward(&layer, x.clone());
    let a = layer.adapter.as_ref().unwrap();
    let expected = layer.base.forward(x.clone()) + x.clone().matmul(a.lora_a.val().transpose()).matmul(a.lora_b.val().transpose()) * 2.0;
    assert!(max_diff(y.clone(), expected) < 1e-4);
    let grads = y.sum().backward();
    assert!(a.lora_a.val().grad(&grads).is_some() && a.lora_b.val().grad(&grads).is_some());
    assert_eq!(GradientsParams::from_grads(grads, &layer).len(), 2);
}
