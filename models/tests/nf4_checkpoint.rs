//! 4-bit checkpoints: a tiny Llama that transformers saved with bitsandbytes NF4 weights (double
//! quantization; `tests/fixtures/nf4/make_nf4.py` on the GPU machine) loads with `load_nf4` and
//! gives transformers + bitsandbytes' logits (f32 compute there); a float checkpoint is quantized
//! on load exactly as the host format quantizes it; damaged 4-bit tensors give errors naming them.

#[path = "../../tests/common/mod.rs"]
mod common;
mod support;

use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};
use kiln::ops::nf4::{Packed4, QuantType};
use kiln_models::{LoadOptions, Nf4Decoder, Nf4Options, load, load_nf4};
use safetensors::SafeTensors;
use support::{fixture, max_abs_err};

fn options(dtype: FloatDType) -> LoadOptions {
    LoadOptions { dtype, max_positions: Some(64) }
}

/// The prompt and transformers + bitsandbytes' f32 logits.
fn expected() -> (Vec<i64>, Vec<f64>) {
    let bytes = std::fs::read(fixture("llama_nf4/expected.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let prompt = file.tensor("prompt").unwrap().data().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    let logits = file.tensor("logits").unwrap().data().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect();
    (prompt, logits)
}

fn logits<B: kiln::KilnBackend>(model: &Nf4Decoder<B>, prompt: &[i64], device: &B::Device) -> Vec<f64> {
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(prompt.to_vec(), [1, prompt.len()]), device);
    common::values(model.forward(tokens))
}

#[test]
fn bitsandbytes_checkpoint_gives_transformers_logits() {
    let (prompt, expected) = expected();
    let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let cpu = Default::default();
    let (_, oracle_model) = load_nf4::<NdArray<f64>>(&fixture("llama_nf4/model"), &options(FloatDType::F64), Nf4Options::default(), &cpu).unwrap();
    let oracle = logits(&oracle_model, &prompt, &cpu);
    // transformers computed in f32 from the same 4-bit weights.
    let err = max_abs_err(&oracle, &expected);
    assert!(err <= 1e-4 * scale.max(1.0), "f64 logits differ from transformers + bitsandbytes by {err:.3e} (scale {scale:.2})");
    let memory = oracle_model.layers[0].up_proj.memory();
    // Code books (1 KiB with double quantization) weigh on a layer this small; `tests/nf4.rs`
    // checks the ~4.13 bits of a full-size layer.
    assert!(memory.weight_bytes * 3 < memory.bf16_bytes, "{memory}");

    let (_, reference_model) = load_nf4::<NdArray<f32>>(&fixture("llama_nf4/model"), &options(FloatDType::F32), Nf4Options::default(), &cpu).unwrap();
    let reference = logits(&reference_model, &prompt, &cpu);
    if let Some(gpu) = common::wgpu_device() {
        let (_, model) = load_nf4::<burn::backend::Wgpu>(&fixture("llama_nf4/model"), &options(FloatDType::F32), Nf4Options::default(), &gpu).unwrap();
        let kernel = logits(&model, &prompt, &gpu);
        let cmp = common::compare("nf4 llama logits", &kernel, &reference, &oracle, DType::F32, model.config.intermediate_size as f64);
        common::assert_all("nf4 checkpoint on wgpu", &[cmp]);
    }
}

#[test]
fn float_checkpoint_is_quantized_on_load_as_the_host_format_does() {
    let cpu = Default::default();
    let nf4 = Nf4Options { kind: QuantType::Fp4, block: 128, double_quant: true };
    let (_, float) = load::<NdArray>(&fixture("llama31"), &options(FloatDType::F32), &cpu).unwrap();
    let (_, quantized) = load_nf4::<NdArray>(&fixture("llama31"), &options(FloatDType::F32), nf4, &cpu).unwrap();
    let weight = float.layers[1].up_proj.weight.val().transpose();
    let dims = weight.dims();
    let host: Vec<f32> = weight.into_data().convert::<f32>().into_vec().unwrap();
    let expected = Packed4::quantize(&host, &dims, nf4.kind, nf4.block, true).unwrap();
    assert_eq!(quantized.layers[1].up_proj.weight().to_host(), expected);
    let prompt: Vec<i64> = (0..9).collect();
    assert!(logits(&quantized, &prompt, &cpu).iter().all(|v| v.is_finite()));
}

/// A copy of the 4-bit fixture with `edit` applied to its tensors.
fn damaged(tag: &str, edit: impl Fn(&mut Vec<support::StoredTensor>)) -> PathBuf {
    support::damaged(&fixture("llama_nf4/model"), &format!("nf4-{tag}"), edit)
}

fn load_error(dir: &Path) -> String {
    match load_nf4::<NdArray>(dir, &options(FloatDType::F32), Nf4Options::default(), &Default::default()) {
        Ok(_) => panic!("{}: loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn damaged_4bit_tensors_are_named() {
    let q = "model.layers.0.self_attn.q_proj.weight";
    let dir = damaged("missing", |t| t.retain(|(n, ..)| n != &format!("{q}.absmax")));
    let msg = load_error(&dir);
    assert!(msg.contains(&format!("{q}.absmax: missing")), "{msg}");
    let dir = damaged("short", |t| t.iter_mut().filter(|(n, ..)| n == &format!("{q}.nested_absmax")).for_each(|(_, _, s, b)| {
        b.extend([0u8; 4]);
        *s = vec![2];
    }));
    let msg = load_error(&dir);
    assert!(msg.contains(&format!("{q}.nested_absmax")) && msg.contains("8 bytes"), "{msg}");
    let dir = damaged("state", |t| t.iter_mut().filter(|(n, ..)| n.ends_with("q_proj.weight.quant_state.bitsandbytes__nf4")).for_each(|(_, _, s, b)| {
        *b = b"{\"quant_type\": \"nf4\", \"blocksize\": 48}".to_vec();
        *s = vec![b.len()];
    }));
    let msg = load_error(&dir);
    assert!(msg.contains(q) && msg.contains("shape"), "{msg}");
    let float = load::<NdArray>(&fixture("llama_nf4/model"), &options(FloatDType::F32), &Default::default()).map(|_| ()).unwrap_err().to_string();
    assert!(float.contains("load_nf4") && float.contains("quant_state.bitsandbytes__nf4"), "{float}");
}
