//! LoRA adapters on the decoder: targeting by name, PEFT files saved and loaded back, adapters
//! saved by PEFT itself giving transformers+PEFT's logits (fixtures from
//! `tests/fixtures/lora/make_lora.py`), and damaged adapter files refused with the file and the
//! tensor or field named.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use burn::module::Param;
use burn::tensor::{FloatDType, Int, Tensor, TensorData, backend::Backend};
use kiln::nn::{LinearLayer, LoraConfig};
use kiln_models::adapter::{LoraDecoder, Targets, add_lora, load_adapter, save_adapter};
use kiln_models::{FloatDecoder, LoadOptions, load};
use safetensors::SafeTensors;

type Cpu = NdArray;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn base<B: Backend>(dtype: FloatDType) -> FloatDecoder<B> {
    let options = LoadOptions { dtype, max_positions: Some(128) };
    load::<B>(&fixture("llama31"), &options, &Default::default()).unwrap().1
}

fn f64s(file: &SafeTensors<'_>, name: &str) -> Vec<f64> {
    file.tensor(name).unwrap().data().chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn prompt() -> Vec<u32> {
    let bytes = std::fs::read(fixture("llama31/expected.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    file.tensor("prompt").unwrap().data().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

fn logits<B: kiln::KilnBackend, L: LinearLayer<B>>(model: &kiln_models::Decoder<B, L>) -> Vec<f64> {
    let ids: Vec<i64> = prompt().iter().map(|&t| t as i64).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [1, ids.len()]), &Default::default());
    common::values(model.forward(tokens))
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// A fresh folder under the system's temporary directory.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-lora-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every adapter's `B` random (a fresh `B` is zero and would hide the adapters).
fn randomized<B: Backend, L: LinearLayer<B>>(model: LoraDecoder<B, L>) -> LoraDecoder<B, L> {
    let mut seed = 100;
    model.map_linears(|_, mut layer| {
        if let Some(adapter) = layer.adapter.as_mut() {
            let dims = adapter.lora_b.dims();
            seed += 1;
            let values = common::random(&dims, seed);
            // In the adapter's dtype: `from_data` gives the device's default, which an f64 test
            // in this process may have set for the shared NdArray device.
            let dtype = FloatDType::from(adapter.lora_b.val().dtype());
            let values: Tensor<B, 2> = Tensor::from_data(values.convert::<f32>(), &Default::default());
            adapter.lora_b = Param::from_tensor(values.cast(dtype));
        }
        layer
    })
}

#[test]
fn targets_match_as_peft_does() {
    let q = "model.layers.0.self_attn.q_proj";
    assert!(Targets::modules(["q_proj"]).matches(q));
    assert!(Targets::modules([q]).matches(q));
    assert!(!Targets::modules(["proj"]).matches(q));
    assert!(!Targets::modules(["v_proj"]).matches(q));
    assert!(Targets::pattern(r".*\.(q|v)_proj").unwrap().matches(q));
    assert!(!Targets::pattern(r"q_proj").unwrap().matches(q), "a pattern matches the whole path");
    assert!(matches!(Targets::pattern("all-linear").unwrap(), Targets::AllLinear));
}

#[test]
fn adapters_save_and_load_back_exactly() {
    let config = LoraConfig::new().with_rank(4).with_alpha(8.0);
    let model = randomized(add_lora(base::<Cpu>(FloatDType::F32), &config, &Targets::modules(["q_proj", "v_proj", "down_proj"])));
    let adapted = logits(&model);
    assert!(max_abs_diff(&adapted, &logits(&base::<Cpu>(FloatDType::F32))) > 1e-3, "the adapters change nothing");
    let dir = scratch("round-trip");
    save_adapter(&model, &dir, Some("llama31")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["target_modules"], serde_json::json!(["down_proj", "q_proj", "v_proj"]));
    assert_eq!(config["r"], 4);
    let loaded = load_adapter(base::<Cpu>(FloatDType::F32), &dir).unwrap();
    assert_eq!(logits(&loaded), adapted);
    let adapters = loaded.linears().iter().filter(|(_, l)| l.adapter.is_some()).count();
    assert_eq!(adapters, 3 * 2);
}

#[test]
fn layers_of_other_ranks_go_through_rank_pattern() {
    let model = add_lora(base::<Cpu>(FloatDType::F32), &LoraConfig::new().with_rank(4), &Targets::modules(["k_proj", "v_proj", "o_proj"]));
    let model = randomized(model.map_linears(|name, layer| {
        if name == "model.layers.1.self_attn.o_proj" {
            let adapter = LoraConfig::new().with_rank(2).init_adapter(layer.d_input(), layer.d_output(), &Default::default());
            kiln::nn::LoraLinear::frozen(layer.base).with_adapter(adapter)
        } else {
            layer
        }
    }));
    let dir = scratch("ranks");
    save_adapter(&model, &dir, None).unwrap();
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["r"], 4);
    assert_eq!(config["rank_pattern"], serde_json::json!({"model.layers.1.self_attn.o_proj": 2}));
    let loaded = load_adapter(base::<Cpu>(FloatDType::F32), &dir).unwrap();
    assert_eq!(logits(&loaded), logits(&model));
}

/// Adapters made and saved by PEFT on the `llama31` fixture (LoRA, rsLoRA, DoRA with a trained
/// magnitude): kiln's f64 logits equal
/// transformers+PEFT's f64 logits (to the f32 RoPE tables' rounding, as in `hf_parity`), and the
/// adapters move the logits by far more than that.
#[test]
fn peft_saved_adapters_give_peft_logits() {
    for name in ["peft_lora", "peft_rslora", "peft_dora"] {
        let dir = fixture("lora").join(name);
        let model = load_adapter(base::<NdArray<f64>>(FloatDType::F64), &dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
        let expected = f64s(&SafeTensors::deserialize(&bytes).unwrap(), "logits");
        let got = logits(&model);
        let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let err = max_abs_diff(&got, &expected);
        // RoPE tables are f32 on every kiln path (as in hf_parity): ~1e-7 relative on the angles.
        assert!(err < 1e-5 * scale.max(1.0), "{name}: logits differ from transformers+PEFT by {err:.3e} (scale {scale:.2})");
        let without = logits(&base::<NdArray<f64>>(FloatDType::F64));
        assert!(max_abs_diff(&without, &expected) > 1e-3, "{name}: the fixture's adapters change nothing");
    }
}

fn write_tensors(path: &Path, tensors: &[(&str, Vec<usize>)]) {
    let data: Vec<(String, Vec<u8>, Vec<usize>)> =
        tensors.iter().map(|(n, s)| (n.to_string(), vec![0u8; 4 * s.iter().product::<usize>()], s.clone())).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, b, s)| (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn load_error(name: &str, config: serde_json::Value, tensors: &[(&str, Vec<usize>)]) -> String {
    let dir = scratch(name);
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    write_tensors(&dir.join("adapter_model.safetensors"), tensors);
    match load_adapter(base::<Cpu>(FloatDType::F32), &dir) {
        Ok(_) => panic!("{name}: a damaged adapter loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn damaged_adapters_are_refused_by_name() {
    let config = serde_json::json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]});
    let a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    let b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
    let err = load_error("half", config.clone(), &[(a, vec![4, 64])]);
    assert!(err.contains("adapter_model.safetensors") && err.contains("lora_B") && err.contains("both"), "{err}");
    let err = load_error("shape", config.clone(), &[(a, vec![4, 63]), (b, vec![64, 4])]);
    assert!(err.contains("lora_A") && err.contains("[4, 63]"), "{err}");
    let stray = "base_model.model.lm_head.lora_A.weight";
    let err = load_error("stray", config.clone(), &[(a, vec![4, 64]), (b, vec![64, 4]), (stray, vec![4, 64])]);
    assert!(err.contains(stray), "{err}");
    let mut dora = config.clone();
    dora["use_dora"] = serde_json::json!(true);
    let err = load_error("dora", dora, &[(a, vec![4, 64]), (b, vec![64, 4])]);
    assert!(err.contains("adapter_model.safetensors") && err.contains("q_proj.lora_magnitude_vector") && err.contains("missing"), "{err}");
    let magnitude = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector";
    let err = load_error("magnitude-without-dora", config.clone(), &[(a, vec![4, 64]), (b, vec![64, 4]), (magnitude, vec![64])]);
    assert!(err.contains(magnitude) && err.contains("use_dora"), "{err}");
    let err = load_error("not-lora", serde_json::json!({"peft_type": "IA3"}), &[]);
    assert!(err.contains("adapter_config.json"), "{err}");
}

/// The other direction: `fixtures/lora/kiln_saved` (LoRA) and `kiln_saved_dora` (DoRA) hold
/// adapters written by kiln's `save_adapter` and kiln's f64 logits with them; `make_lora.py`
/// loaded them with PEFT and recorded how far transformers+PEFT's logits were from kiln's
/// (`peft_check.json`). Here kiln must still read its own files to the same logits, and PEFT's
/// recorded difference must be within the f32 RoPE tables' rounding.
/// `KILN_WRITE_FIXTURES=1` rewrites both adapters, `KILN_WRITE_FIXTURES=kiln_saved_dora` one of
/// them (new random values: rerun `make_lora.py` after).
#[test]
fn kiln_saved_adapters_load_in_peft() {
    let targets = Targets::modules(["k_proj", "o_proj", "gate_proj", "up_proj"]);
    check_kiln_saved("kiln_saved", &LoraConfig::new().with_rank(4).with_alpha(16.0).with_rslora(true), &targets);
    check_kiln_saved("kiln_saved_dora", &LoraConfig::new().with_rank(4).with_alpha(8.0).with_dora(true), &targets);
}

fn check_kiln_saved(name: &str, config: &LoraConfig, targets: &Targets) {
    let dir = fixture("lora").join(name);
    let write = std::env::var("KILN_WRITE_FIXTURES").is_ok_and(|v| v == "1" || v.split(',').any(|n| n == name));
    if write {
        let model = randomized(add_lora(base::<Cpu>(FloatDType::F32), config, targets));
        save_adapter(&model, &dir, Some("llama31")).unwrap();
        let _ = std::fs::remove_file(dir.join("peft_check.json"));
        let _ = std::fs::remove_file(dir.join("kiln_logits.safetensors"));
    }
    let model = load_adapter(base::<NdArray<f64>>(FloatDType::F64), &dir).unwrap();
    let got = logits(&model);
    let path = dir.join("kiln_logits.safetensors");
    if !path.exists() {
        let bytes: Vec<u8> = got.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![prompt().len(), got.len() / prompt().len()], &bytes).unwrap();
        safetensors::serialize_to_file([("logits".to_string(), view)], None, &path).unwrap();
    }
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(got, f64s(&SafeTensors::deserialize(&bytes).unwrap(), "logits"), "{name}: kiln reads its own adapter to other logits");
    if write {
        return;
    }
    let check: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("peft_check.json")).expect("run make_lora.py on the GPU machine")).unwrap();
    let (diff, scale, effect) = (check["max_abs_diff_vs_kiln"].as_f64().unwrap(), check["max_abs_logit"].as_f64().unwrap(), check["max_abs_diff_adapter_effect"].as_f64().unwrap());
    assert!(diff < 1e-5 * scale.max(1.0), "{name}: PEFT's logits with kiln's adapter differ by {diff:.3e}");
    assert!(effect > 1e-3, "{name}: kiln's adapter changed PEFT's logits by only {effect:.3e}");
}
