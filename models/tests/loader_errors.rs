//! Bad checkpoints are `Err`s naming the file and field or tensor, never panics: configs with
//! missing, mistyped or unsupported fields; safetensors truncated at every header offset and in
//! the data, mutated at random, or disagreeing with the config.

use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use burn::tensor::FloatDType;
use kiln_models::config::from_hf_value;
use kiln_models::loader::{ParamKind, ParamSource, SafetensorsSource};
use kiln_models::{LoadOptions, load};
use serde_json::json;

type B = NdArray<f32>;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-models-errors-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn config(overrides: serde_json::Value) -> serde_json::Value {
    let mut base: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("llama31").join("config.json")).unwrap()).unwrap();
    for (k, v) in overrides.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

fn config_error(overrides: serde_json::Value) -> String {
    from_hf_value(&config(overrides), Path::new("cfg/config.json")).unwrap_err().to_string()
}

#[test]
fn config_errors_name_the_field() {
    let cases = [
        (json!({"model_type": "gpt_neox"}), "model_type"),
        (json!({"hidden_size": null}), "hidden_size"),
        (json!({"hidden_size": "64"}), "hidden_size"),
        (json!({"num_attention_heads": -4}), "num_attention_heads"),
        (json!({"hidden_act": "gelu"}), "hidden_act"),
        (json!({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}), "rope_parameters.rope_type"),
        (json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}), "low_freq_factor"),
        (json!({"eos_token_id": [1, "x"]}), "eos_token_id"),
        (json!({"num_key_value_heads": 3}), "num_kv_heads"),
    ];
    for (overrides, field) in cases {
        let err = config_error(overrides.clone());
        assert!(err.contains("cfg/config.json") && err.contains(field), "{overrides}: {err}");
    }
}

#[test]
fn hub_configs_parse() {
    // Llama 3.2 1B as published (legacy rope_theta + rope_scaling, tied, bf16).
    let llama32 = json!({
        "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
        "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 128256
    });
    let (_, c) = from_hf_value(&llama32, Path::new("llama32.json")).unwrap();
    assert!(c.tie_embeddings && c.rope_theta == 500000.0 && c.eos_token_ids == [128001]);
    assert!(matches!(c.rope_scaling, kiln::ops::rope::RopeScaling::Llama3 { factor: 32.0, original_max_positions: 8192, .. }));
    assert_eq!(c.num_params(), 1_235_814_400, "Llama 3.2 1B's published parameter count");
    // Qwen2.5 0.5B: sliding window present but unused; q/k/v biases.
    let qwen = json!({
        "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
        "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
        "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
    });
    let (_, c) = from_hf_value(&qwen, Path::new("qwen.json")).unwrap();
    assert!(c.qkv_bias && !c.o_bias && c.sliding_window.is_none() && c.head_dim == 64);
    assert_eq!(c.num_params(), 494_032_768, "Qwen2.5-0.5B's published parameter count");
    // Mistral 7B v0.1: a window on every layer, head_dim from hidden/heads.
    let mistral = json!({
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "vocab_size": 32000, "max_position_embeddings": 32768, "hidden_act": "silu"
    });
    let (_, c) = from_hf_value(&mistral, Path::new("mistral.json")).unwrap();
    assert_eq!((c.window(0), c.window(31), c.head_dim), (Some(4096), Some(4096), 128));
}

/// A copy of a fixture whose `model.safetensors` is replaced by `bytes`.
fn with_weights(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = tempdir(name);
    std::fs::copy(fixture("mistral").join("config.json"), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    dir
}

fn load_result(dir: &Path) -> Result<(), String> {
    let device = Default::default();
    let loaded = std::panic::catch_unwind(|| load::<B>(dir, &LoadOptions { max_positions: Some(64), ..Default::default() }, &device).map(|_| ()));
    match loaded {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => panic!("loading {} panicked", dir.display()),
    }
}

#[test]
fn truncated_and_mutated_safetensors_are_errors() {
    let good = std::fs::read(fixture("mistral").join("model.safetensors")).unwrap();
    let header = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let dir = with_weights("truncated", &good);
    assert!(load_result(&dir).is_ok());
    let path = dir.join("model.safetensors");
    let mut cuts: Vec<usize> = (0..header + 16).collect();
    cuts.extend((1..16).map(|i| header + (good.len() - header) * i / 16));
    cuts.push(good.len() - 1);
    for cut in cuts {
        std::fs::write(&path, &good[..cut]).unwrap();
        let err = load_result(&dir).expect_err(&format!("truncated at {cut} loaded"));
        assert!(err.contains("model.safetensors"), "cut {cut}: {err}");
    }
    // Random byte changes in the header (and a few in the data, which may stay loadable).
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..300 {
        let mut bytes = good.clone();
        for _ in 0..1 + next() % 4 {
            let at = if next() % 8 == 0 { (next() as usize) % bytes.len() } else { (next() as usize) % header };
            bytes[at] = next() as u8;
        }
        std::fs::write(&path, &bytes).unwrap();
        let _ = load_result(&dir);
    }
    // An absurd header length is refused without allocating it.
    let mut bytes = good.clone();
    bytes[..8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert!(load_result(&dir).unwrap_err().contains("model.safetensors"));
}

#[test]
fn weights_disagreeing_with_the_config_name_the_tensor() {
    let dir = tempdir("disagree");
    let good = fixture("mistral");
    std::fs::copy(good.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    // One hidden size more: the embedding's shape no longer fits.
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(good.join("config.json")).unwrap()).unwrap();
    config["intermediate_size"] = json!(97);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_result(&dir).unwrap_err();
    assert!(err.contains("gate_proj.weight") && err.contains("shape"), "{err}");
    // One layer fewer: a stored tensor the model lacks.
    config["intermediate_size"] = json!(96);
    config["num_hidden_layers"] = json!(1);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_result(&dir).unwrap_err();
    assert!(err.contains("model.layers.1."), "{err}");
    // A missing tensor.
    let mut source = SafetensorsSource::open(&good, FloatDType::F32).unwrap();
    let err = source.param::<B, 1>("model.layers.9.input_layernorm.weight", [64], ParamKind::Norm, &Default::default()).unwrap_err().to_string();
    assert!(err.contains("model.layers.9.input_layernorm.weight") && err.contains("missing"), "{err}");
}

#[test]
fn sharded_index_with_a_path_outside_is_refused() {
    let dir = tempdir("index");
    std::fs::copy(fixture("qwen2").join("config.json"), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("model.safetensors.index.json"), r#"{"weight_map": {"model.norm.weight": "../../etc/passwd"}}"#).unwrap();
    let err = load_result(&dir).unwrap_err();
    assert!(err.contains("weight_map.model.norm.weight"), "{err}");
}
