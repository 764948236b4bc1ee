//! NF4/FP4: the host format against bitsandbytes' own CUDA kernels (fixtures from
//! `tests/fixtures/nf4/make_nf4.py`), the kernels against the host format (exact), and the 4-bit
//! product and its input gradient against the reference (DEVELOPERS.md's error rule).

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor, TensorData};
use common::checks::{Nf4Case, assert_cases};
use kiln::ops::nf4::{Absmax, Packed4, QuantType, Quantized4, format::DYNAMIC_CODE};
use safetensors::{Dtype, SafeTensors};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/nf4/bnb4.safetensors");
const INPUTS: [(&str, [usize; 2]); 3] = [("normal", [130, 136]), ("bf16", [130, 136]), ("extreme", [3, 4096])];
const KINDS: [QuantType; 2] = [QuantType::Nf4, QuantType::Fp4];
const BLOCKS: [usize; 3] = [64, 128, 4096];

struct Fixtures(Vec<u8>);

impl Fixtures {
    fn load() -> Self {
        Self(std::fs::read(FIXTURES).expect("tests/fixtures/nf4/bnb4.safetensors"))
    }

    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.0).expect("fixture file")
    }

    fn bytes(&self, name: &str) -> Vec<u8> {
        self.tensors().tensor(name).unwrap_or_else(|_| panic!("fixture {name}")).data().to_vec()
    }

    /// An f32 or bf16 tensor as f32 values.
    fn floats(&self, name: &str) -> Vec<f32> {
        let st = self.tensors();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("fixture {name}"));
        match t.dtype() {
            Dtype::F32 => t.data().chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
            Dtype::BF16 => t.data().chunks(2).map(|b| half::bf16::from_le_bytes(b.try_into().unwrap()).to_f32()).collect(),
            other => panic!("fixture {name}: dtype {other:?}"),
        }
    }
}

fn case_name(input: &str, kind: QuantType, block: usize, nested: bool) -> String {
    format!("{input}.{}.b{block}{}", kind.name(), if nested { ".nested" } else { "" })
}

/// Whether `x` lies within two ulps of a rounding threshold of `kind` (where bitsandbytes' fast
/// reciprocal may round the other way).
fn near_threshold(kind: QuantType, x: f32) -> bool {
    let x = if kind == QuantType::Fp4 { x.abs() } else { x };
    kind.thresholds().iter().any(|t| (t - x).abs() <= 2.0 * f32::EPSILON * t.abs().max(f32::MIN_POSITIVE))
}

/// Compare packed codes element by element: every difference must sit at a threshold.
fn assert_codes(case: &str, kind: QuantType, values: &[f32], block: usize, ours: &Packed4, theirs: &[u8]) -> usize {
    assert_eq!(ours.data.len(), theirs.len(), "{case}: packed length");
    let absmax = ours.absmax.values();
    let mut differing = 0;
    for (i, &v) in values.iter().enumerate() {
        let theirs_code = if i % 2 == 0 { theirs[i / 2] >> 4 } else { theirs[i / 2] & 15 };
        if ours.code_at(i) != theirs_code {
            let scaled = v * (1.0 / absmax[i / block]);
            assert!(near_threshold(kind, scaled), "{case}: element {i} ({v}, scaled {scaled}) has code {} here, {theirs_code} in bitsandbytes", ours.code_at(i));
            differing += 1;
        }
    }
    differing
}

#[test]
fn host_quantization_matches_bitsandbytes() {
    let fx = Fixtures::load();
    let mut differing = 0;
    for (input, shape) in INPUTS {
        let values = fx.floats(&format!("input.{input}"));
        for kind in KINDS {
            for block in BLOCKS {
                let case = case_name(input, kind, block, false);
                let ours = Packed4::quantize(&values, &shape, kind, block, false).unwrap();
                let Absmax::Plain(absmax) = &ours.absmax else { unreachable!() };
                let theirs = fx.floats(&format!("{case}.absmax"));
                assert!(absmax.iter().zip(&theirs).all(|(a, b)| a.to_bits() == b.to_bits()), "{case}: absmax differs");
                differing += assert_codes(&case, kind, &values, block, &ours, &fx.bytes(&format!("{case}.packed")));

                // Double quantization of the same absmax around bitsandbytes' offset: exact.
                let nested = case_name(input, kind, block, true);
                let offset = fx.floats(&format!("{nested}.offset"))[0];
                let Absmax::Nested { codes, absmax: scales, offset: o } = Absmax::nested_with_offset(absmax, offset) else { unreachable!() };
                assert_eq!(o, offset);
                assert_eq!(codes, fx.bytes(&format!("{nested}.absmax")), "{nested}: 8-bit absmax codes");
                let theirs_scales = fx.floats(&format!("{nested}.nested_absmax"));
                assert!(scales.iter().zip(&theirs_scales).all(|(a, b)| a.to_bits() == b.to_bits()), "{nested}: nested absmax {scales:?} vs {theirs_scales:?}");
                // kiln's own offset (an f64 mean) is bitsandbytes' within an ulp.
                let Absmax::Nested { offset: own, .. } = Absmax::nested(absmax) else { unreachable!() };
                assert!((own - offset).abs() <= f32::EPSILON * offset.abs(), "{nested}: offset {own} vs {offset}");
            }
        }
    }
    eprintln!("codes differing from bitsandbytes (all at a rounding threshold): {differing}");
}

#[test]
fn host_dequantization_matches_bitsandbytes() {
    let fx = Fixtures::load();
    let shape = [130, 136];
    for kind in KINDS {
        for nested in [false, true] {
            let case = case_name("normal", kind, 64, nested);
            let absmax = if nested {
                Absmax::Nested {
                    codes: fx.bytes(&format!("{case}.absmax")),
                    absmax: fx.floats(&format!("{case}.nested_absmax")),
                    offset: fx.floats(&format!("{case}.offset"))[0],
                }
            } else {
                Absmax::Plain(fx.floats(&format!("{case}.absmax")))
            };
            let packed = Packed4::from_parts(kind, 64, &shape, fx.bytes(&format!("{case}.packed")), absmax).unwrap();
            let ours = packed.dequantize();
            let theirs = fx.floats(&format!("{case}.dequant"));
            let same = ours.iter().zip(&theirs).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
            assert_eq!(same, theirs.len(), "{case}: {} of {} dequantized values differ", theirs.len() - same, theirs.len());
        }
    }
    let code = fx.floats("quant_map.dynamic");
    assert!(code.iter().zip(DYNAMIC_CODE.iter()).all(|(a, b)| a.to_bits() == b.to_bits()), "dynamic code book");
    for kind in KINDS {
        let theirs = fx.floats(&format!("quant_map.{}", kind.name()));
        // Equal as values: bitsandbytes' FP4 map has +0 at code 8, where its kernels compute −0.
        assert!(theirs.iter().zip(kind.code()).all(|(a, b)| a == b), "{kind:?} code book {theirs:?}");
    }
}

#[test]
fn nf4_error_statistics_match_bitsandbytes() {
    let fx = Fixtures::load();
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(FIXTURES.replace(".safetensors", ".json")).unwrap()).unwrap();
    let theirs = meta["nf4_b64_mean_abs_err"].as_f64().unwrap();
    let values = fx.floats("input.normal");
    let packed = Packed4::quantize(&values, &[130, 136], QuantType::Nf4, 64, false).unwrap();
    let ours = packed.dequantize().iter().zip(&values).map(|(a, b)| (a - b).abs() as f64).sum::<f64>() / values.len() as f64;
    assert!((ours - theirs).abs() < 1e-6 && (0.07..0.075).contains(&ours), "mean |err| {ours} vs bitsandbytes {theirs}");
}

/// Weights of awkward sizes: odd rows, rows that are not whole words or blocks, one short block.
const QUANTIZE_SHAPES: [[usize; 2]; 3] = [[33, 96], [7, 100], [65, 4104]];

fn host_values(shape: [usize; 2], seed: u64, dtype: DType) -> (TensorData, Vec<f32>) {
    let data = common::random(&shape, seed);
    // A block of zeros (code 0 with absmax 0, as in bitsandbytes) in every weight.
    let mut v: Vec<f64> = data.to_vec().unwrap();
    v.iter_mut().take(64).for_each(|x| *x = 0.0);
    let data = TensorData::new(v, shape.to_vec()).convert_dtype(dtype);
    let host = data.clone().convert::<f32>().into_vec::<f32>().unwrap();
    (data, host)
}

/// The quantization kernel writes the host format's codes and absmax exactly; dequantization is
/// exact with plain scales and within an ulp of the scale with nested ones (a fused multiply-add).
/// Double quantization runs on the host, so one block size covers it.
fn kernels_agree_with_host<B: kiln::KilnBackend>(device: &B::Device, dtype: DType, shapes: &[[usize; 2]]) {
    for (s, &shape) in shapes.iter().enumerate() {
        let (data, host) = host_values(shape, 40 + s as u64, dtype);
        for kind in KINDS {
            for block in [32, 64, 4096] {
                let nested = block == 64;
                let what = format!("{shape:?} {kind:?} block {block} nested {nested} {dtype:?}");
                common::poison::<B>(device, shape[0] * shape[1], DType::F32);
                let w = Quantized4::<B>::quantize(Tensor::from_data(data.clone(), (device, dtype)), kind, block, nested);
                let ours = w.to_host();
                let expected = Packed4::quantize(&host, &shape, kind, block, nested).unwrap();
                assert_eq!(ours.data, expected.data, "{what}: codes");
                let (a, b) = (ours.absmax.values(), expected.absmax.values());
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: absmax");
                let deq = common::values(w.dequantize(DType::F32));
                let exact = expected.dequantize();
                let ulps = if nested { 1.0 } else { 0.0 };
                for (i, (x, y)) in deq.iter().zip(&exact).enumerate() {
                    let scale = a[i / block] as f64;
                    assert!((x - *y as f64).abs() <= ulps * f32::EPSILON as f64 * scale, "{what}: dequantized value {i}: {x} vs {y}");
                }
            }
        }
    }
}

#[test]
fn kernels_agree_with_host_format_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    kernels_agree_with_host::<burn::backend::Wgpu>(&device, DType::F32, &QUANTIZE_SHAPES);
    kernels_agree_with_host::<burn::backend::Wgpu>(&device, DType::F16, &QUANTIZE_SHAPES[..1]);
}

#[test]
fn reference_agrees_with_host_format_on_ndarray() {
    kernels_agree_with_host::<NdArray>(&Default::default(), DType::F32, &QUANTIZE_SHAPES);
}

fn cases() -> Vec<Nf4Case> {
    let case = |m, k, n, kind, block, nested, seed| Nf4Case { m, k, n, kind, block, nested, seed };
    vec![
        case(1, 256, 96, QuantType::Nf4, 64, false, 1),
        case(3, 96, 33, QuantType::Nf4, 64, true, 2),
        case(8, 520, 17, QuantType::Fp4, 128, false, 3),
        case(5, 1032, 12, QuantType::Nf4, 32, true, 4),
        case(17, 96, 33, QuantType::Nf4, 64, true, 5),
        case(2, 100, 9, QuantType::Nf4, 64, false, 6),
        case(64, 200, 48, QuantType::Fp4, 64, true, 7),
    ]
}

#[test]
fn matmul_4bit_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases(), &device, &[DType::F32, DType::F16]);
}

#[test]
fn matmul_4bit_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

#[test]
fn bad_layouts_are_refused_clearly() {
    let device = Default::default();
    let w = Tensor::<NdArray, 2>::ones([3, 5], &device);
    let msg = common::panic_message(|| Quantized4::<NdArray>::quantize(w, QuantType::Nf4, 64, false));
    assert!(msg.contains("[3, 5]") && msg.contains("even"), "{msg}");
    let w = Tensor::<NdArray, 2>::ones([4, 64], &device);
    let msg = common::panic_message(|| Quantized4::<NdArray>::quantize(w, QuantType::Nf4, 100, false));
    assert!(msg.contains("block size 100"), "{msg}");
    let q = Quantized4::<NdArray>::quantize(Tensor::ones([4, 64], &device), QuantType::Nf4, 64, false);
    let msg = common::panic_message(|| kiln::ops::matmul_4bit(Tensor::<NdArray, 2>::ones([2, 63], &device), &q));
    assert!(msg.contains("kiln::matmul_4bit") && msg.contains("[2, 63]") && msg.contains("[4, 64]"), "{msg}");
    let p = Packed4::quantize(&[1.0; 128], &[2, 64], QuantType::Nf4, 64, false).unwrap();
    let bad = Packed4::from_parts(QuantType::Nf4, 64, &[2, 64], p.data.clone(), Absmax::Plain(vec![1.0; 3]));
    assert!(bad.unwrap_err().to_string().contains("absmax has 3 blocks"));
    let three_d = Packed4::quantize(&[1.0; 128], &[2, 2, 32], QuantType::Nf4, 64, false).unwrap();
    assert!(Quantized4::<NdArray>::from_host(&three_d, &device).unwrap_err().to_string().contains("two dimensions"));
}

#[test]
fn nf4_linear_saves_loads_and_stays_frozen() {
    use burn::module::Module;
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    use kiln::nn::{LinearConfig, Nf4Linear, Nf4LinearConfig};
    type A = Autodiff<NdArray>;
    let device = Default::default();
    let float = LinearConfig::new(256, 96).init::<A>(&device);
    let layer = Nf4Linear::from_linear(&float, QuantType::Nf4, 64, true);
    let x = Tensor::<A, 3>::from_data(common::random(&[2, 3, 256], 9), &device).require_grad();
    let y = layer.forward(x.clone());

    // The record round-trips into a layer built from the config.
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(layer.clone().into_record(), ()).unwrap();
    let config = Nf4LinearConfig::new(256, 96);
    let loaded = config.init::<A>(&device).load_record(recorder.load(bytes, &device).unwrap());
    assert_eq!(loaded.weight().to_host(), layer.weight().to_host());
    assert_eq!(common::values(loaded.forward(x.clone())), common::values(y.clone()));

    // The input gets a gradient; no part of the layer does.
    let grads = y.sum().backward();
    assert!(x.grad(&grads).is_some());
    assert!(layer.absmax.val().grad(&grads).is_none() && layer.code.val().grad(&grads).is_none());
    assert!(layer.bias.as_ref().unwrap().val().grad(&grads).is_none());
    let params = burn::optim::GradientsParams::from_grads(grads, &layer);
    assert!(params.is_empty(), "an optimizer would find {} gradients in the frozen layer", params.len());

    // A full-size layer at block 64 with double quantization: ~4.13 bits a weight.
    let big = Nf4Linear::<NdArray>::from_linear(&LinearConfig::new(1024, 1024).with_bias(false).init(&device), QuantType::Nf4, 64, true);
    let memory = big.memory();
    assert!((memory.bits_per_weight - 4.127).abs() < 0.01, "{memory}");
}
