//! DoRA: the rescaling op (forward, `du`, `dm`) against its formula; the factored weight norm
//! against the dense one, and its kernels against the factored formula; DoRA layers (float and
//! 4-bit bases, rsLoRA, bias, dropout) against PEFT's dense formula with every gradient; a fresh
//! DoRA layer equals its base; merge/unmerge; training touches only `A`, `B` and `m`.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{DType, Tensor, backend::Backend};
use common::adapters::{DoraCase, DoraLayerCase, DoraNormCase};
use common::checks::assert_cases;
use kiln::nn::{LinearConfig, LinearLayer, LoraConfig, LoraLinear, Nf4Linear};
use kiln::ops::nf4::QuantType;
use kiln::ops::{dora, dora_norm};

fn op_cases() -> Vec<DoraCase> {
    let case = |batch, m, d_out, bias, seed| DoraCase { batch, m, d_out, bias, seed };
    // Widths that take 4-, 2- and 1-element vectors; row counts past one lane pass.
    vec![case(1, 1, 8, false, 1), case(2, 37, 70, true, 2), case(3, 100, 33, false, 3), case(1, 513, 256, true, 4)]
}

fn norm_cases() -> Vec<DoraNormCase> {
    let case = |d_in, d_out, rank, seed| DoraNormCase { d_in, d_out, rank, scale: 1.7, seed };
    // Rank 1, a rank past one plane, a rank above `in`; `in` that takes 1-, 2- and 4-element
    // vectors and loops over a row (1000); outputs past one cube.
    vec![case(16, 8, 1, 1), case(70, 45, 6, 2), case(1000, 33, 17, 3), case(40, 300, 64, 4), case(33, 10, 100, 5)]
}

fn layer_cases() -> Vec<DoraLayerCase> {
    let case = |batch, m, d_in, d_out, rank, rslora, bias, dropout, seed| DoraLayerCase { batch, m, d_in, d_out, rank, rslora, bias, dropout, seed };
    vec![
        case(1, 1, 16, 8, 1, false, false, 0.0, 1),
        case(2, 17, 33, 20, 8, true, true, 0.0, 2),
        case(1, 9, 40, 64, 64, false, false, 0.0, 3),
        case(2, 5, 48, 24, 4, false, true, 0.25, 4),
    ]
}

#[test]
fn dora_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&op_cases(), &device, &[DType::F32, DType::F16]);
}

#[test]
fn dora_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&op_cases(), &Default::default(), &[DType::F32]);
}

#[test]
fn dora_norm_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&norm_cases(), &device, &[DType::F32, DType::F16]);
}

#[test]
fn dora_norm_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&norm_cases(), &Default::default(), &[DType::F32]);
}

/// On lavapipe each product shape is autotuned (minutes a layer): wgpu checks the layer with a
/// bias and dropout; the op's own cases cover f16, NdArray every layer case.
#[test]
fn dora_layer_matches_peft_formula_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&[layer_cases()[3]], &device, &[DType::F32]);
}

#[test]
fn dora_layer_matches_peft_formula_on_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&layer_cases(), &Default::default(), &[DType::F32]);
}

type Ad = Autodiff<NdArray>;

fn input(rows: usize, cols: usize, seed: u64) -> Tensor<Ad, 2> {
    common::tensor(&common::random(&[rows, cols], seed), DType::F32, &Default::default())
}

fn max_diff<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f64 {
    let (a, b) = (common::values(a), common::values(b));
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

fn dora_config(rank: usize) -> LoraConfig {
    LoraConfig::new().with_rank(rank).with_alpha(2.0 * rank as f64).with_dora(true)
}

/// A DoRA layer over `base` whose `B` is random (a fresh one is zero, which would hide the update).
fn adapted<L: LinearLayer<Ad>>(base: L, rank: usize) -> LoraLinear<Ad, L> {
    let mut layer = dora_config(rank).init(base, &Default::default());
    let adapter = layer.adapter.as_mut().unwrap();
    let [d_out, r] = adapter.lora_b.dims();
    adapter.lora_b = Param::from_tensor(input(d_out, r, 99) * 0.1);
    layer
}

#[test]
fn factored_norm_equals_the_dense_norm() {
    let (d_in, d_out, r, s) = (70, 45, 6, 1.7);
    let w = input(d_in, d_out, 1).inner();
    let (a, b) = (input(r, d_in, 2).inner(), input(d_out, r, 3).inner());
    let dense = (w.clone() + a.clone().transpose().matmul(b.clone().transpose()) * s).square().sum_dim(0).sqrt().squeeze_dim::<1>(0);
    let norms_sq = w.clone().square().sum_dim(0).squeeze_dim::<1>(0);
    let factored = dora_norm(norms_sq, a.clone().matmul(w), a, b, s);
    let err = max_diff(factored, dense.clone());
    assert!(err < 1e-4 * common::values(dense).iter().fold(0.0, |m: f64, v| m.max(*v)), "factored vs dense norm: {err}");
}

#[test]
fn fresh_dora_layer_equals_its_base_and_trains_only_its_adapter() {
    let base = LinearConfig::new(24, 12).init::<Ad>(&Default::default());
    let x = input(5, 24, 1);
    let expected = base.forward(x.clone());
    let mut layer = dora_config(4).with_dropout(0.1).init(base, &Default::default());
    let magnitude = layer.adapter.as_ref().unwrap().magnitude.as_ref().expect("a DoRA adapter has a magnitude").val();
    let norms = layer.base.weight.val().square().sum_dim(0).sqrt().squeeze_dim::<1>(0);
    assert!(max_diff(magnitude, norms) < 1e-6, "the magnitude starts at the base's row norms");
    assert!(max_diff(LinearLayer::forward(&layer.valid(), x.clone().inner()), expected.inner()) < 1e-6);

    let weight_before = layer.base.weight.val().into_data();
    let mut optimizer = AdamWConfig::new().init();
    for step in 0..3 {
        let loss = LinearLayer::forward(&layer, input(5, 24, 10 + step)).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        assert_eq!(grads.len(), 3, "only lora_A, lora_B and the magnitude take gradients");
        layer = optimizer.step(1e-2, layer, grads);
    }
    assert_eq!(layer.base.weight.val().into_data(), weight_before, "training changed the base weight");
}

#[test]
fn dora_merge_and_unmerge_round_trip() {
    let base = LinearConfig::new(40, 20).init::<Ad>(&Default::default());
    let mut layer = adapted(base, 8).valid();
    let adapter = layer.adapter.as_mut().unwrap();
    let magnitude = adapter.magnitude.as_ref().unwrap().val();
    adapter.magnitude = Some(Param::from_tensor(magnitude * 1.3));
    let x = input(7, 40, 3).inner();
    let unmerged = LinearLayer::forward(&layer, x.clone());
    let original = layer.base.weight.val();
    layer.merge();
    assert!(layer.merged && layer.merged_scale.is_some());
    assert!(max_diff(LinearLayer::forward(&layer, x.clone()), unmerged.clone()) < 1e-4);
    assert!(max_diff(layer.base.weight.val(), original.clone()) > 1e-3, "merge changed nothing");
    layer.unmerge();
    assert!(max_diff(layer.base.weight.val(), original) < 1e-5);
    let merged = layer.merge_and_unload();
    assert!(max_diff(merged.forward(x), unmerged) < 1e-4);
}

/// QDoRA: DoRA over the 4-bit base equals DoRA over a float layer holding the dequantized weight.
#[test]
fn dora_over_a_4bit_base_equals_dora_over_its_dequantized_weight() {
    let float = LinearConfig::new(128, 48).init::<Ad>(&Default::default());
    let nf4 = Nf4Linear::from_linear(&float, QuantType::Nf4, 64, true);
    let dequantized = kiln::nn::Linear { weight: Param::from_tensor(nf4.dequantize(DType::F32)), bias: float.bias.clone() };
    let quantized = adapted(nf4, 8);
    let mut reference = dora_config(8).init(dequantized, &Default::default());
    reference.adapter = quantized.adapter.clone();
    let x = input(9, 128, 6);
    let (y, expected) = (LinearLayer::forward(&quantized, x.clone()), LinearLayer::forward(&reference, x));
    assert!(max_diff(y.clone(), expected) < 1e-4);
    assert_eq!(GradientsParams::from_grads(y.sum().backward(), &quantized).len(), 3);
}

#[test]
fn dora_rejects_bad_shapes_and_a_trained_bias() {
    let device = Default::default();
    let u = Tensor::<NdArray, 2>::ones([3, 8], &device);
    let msg = common::panic_message(|| dora(u.clone(), Tensor::ones([7], &device), Tensor::ones([8], &device), None));
    assert!(msg.contains("kiln::dora") && msg.contains("[3, 8]") && msg.contains("[7]"), "{msg}");
    let ones = |n| Tensor::<Ad, 1>::ones([n], &Default::default());
    let msg = common::panic_message(|| dora(Tensor::<Ad, 2>::ones([3, 8], &Default::default()), ones(8), ones(8), Some(ones(8).require_grad())));
    assert!(msg.contains("kiln::dora") && msg.contains("bias"), "{msg}");
}
