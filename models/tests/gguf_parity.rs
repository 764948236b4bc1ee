//! GGUF checkpoints of the HF fixtures (`fixtures/make_gguf.py`, written with gguf-py the way
//! llama.cpp's converter writes them): dequantization bit-exact with gguf-py's own (a fingerprint
//! per tensor, and the k-quant probe's values in full), the config and tokenizer read from the
//! metadata, and the logits of F32/F16 files equal to transformers' within the f32 rule; the
//! 4-bit and 8-bit files within their quantization error.

use std::path::PathBuf;

use burn::backend::NdArray;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use kiln_models::config::from_hf_json;
use kiln_models::gguf::GgufFile;
use kiln_models::loader::config_from_gguf;
use kiln_models::{LoadOptions, Tokenizer, load};
use safetensors::SafeTensors;

type B = NdArray<f32>;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn manifest() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("gguf/manifest.json")).unwrap()).unwrap()
}

fn fnv1a64(values: &[f32]) -> String {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in values.iter().flat_map(|v| v.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
    }
    format!("{h:016x}")
}

#[test]
fn dequantization_is_bit_exact_with_gguf_py() {
    let manifest = manifest();
    let mut checked = 0;
    for (file, entry) in manifest.as_object().unwrap() {
        let Some(hashes) = entry.get("dequant_fnv1a64") else { continue };
        let gguf = GgufFile::open(&fixtures().join("gguf").join(file)).unwrap();
        for (tensor, hash) in hashes.as_object().unwrap() {
            let (_, values) = gguf.tensor_f32(tensor).unwrap();
            assert_eq!(fnv1a64(&values), hash.as_str().unwrap(), "{file}: {tensor} ({})", entry["types"][tensor]);
            checked += 1;
        }
    }
    assert!(checked > 200, "only {checked} tensors checked");
    // The probe's Q4_K/Q6_K (real k-quant blocks, also random bytes), Q8_0, Q4_0, BF16: values in full.
    let probe = GgufFile::open(&fixtures().join("gguf/quant_probe.gguf")).unwrap();
    let bytes = std::fs::read(fixtures().join("gguf/quant_probe.dequant.safetensors")).unwrap();
    let reference = SafeTensors::deserialize(&bytes).unwrap();
    for (name, view) in reference.tensors() {
        let expected: Vec<f32> = view.data().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        let (_, values) = probe.tensor_f32(&name).unwrap();
        assert!(values.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}");
    }
}

#[test]
fn config_from_metadata_matches_config_json() {
    let files = [
        ("llama31", "llama31.F32.gguf"),
        ("qwen2", "qwen2.Q8_0.gguf"),
        ("qwen3", "qwen3.F16.gguf"),
        ("mistral", "mistral.Q8_0.gguf"),
        ("bitnet_auto", "bitnet_auto.F32.gguf"),
    ];
    for (family, file) in files {
        let (hf_family, hf) = from_hf_json(&fixtures().join(family)).unwrap();
        let (gguf_family, gguf) = config_from_gguf(&GgufFile::open(&fixtures().join("gguf").join(file)).unwrap()).unwrap();
        assert_eq!(hf_family, gguf_family, "{file}");
        let shape = |c: &kiln_models::DecoderConfig| {
            (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim)
        };
        assert_eq!(shape(&hf), shape(&gguf), "{file}");
        let flags = |c: &kiln_models::DecoderConfig| {
            (c.qkv_bias, c.o_bias, c.qk_norm, c.sub_norms, c.activation, c.tie_embeddings, c.window(0), c.eos_token_ids.clone())
        };
        assert_eq!(flags(&hf), flags(&gguf), "{file}");
        // Llama 3.1 scaling arrives as per-frequency divisors: the same frequencies.
        for (a, b) in hf.rope_inv_freq().iter().zip(gguf.rope_inv_freq()) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{file}: rope frequency {a} vs {b}");
        }
        assert!((hf.rms_norm_eps - gguf.rms_norm_eps).abs() < 1e-9, "{file}: eps");
    }
}

fn logits(model: &kiln_models::FloatDecoder<B>, prompt: &[u32]) -> Vec<f32> {
    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, prompt.len()]), &Default::default());
    model.forward(tokens).into_data().to_vec::<f32>().unwrap()
}

fn expected(family: &str) -> (Vec<u32>, Vec<f64>) {
    let bytes = std::fs::read(fixtures().join(family).join("expected.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let prompt = file.tensor("prompt").unwrap().data().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect();
    let logits = file.tensor("logits").unwrap().data().chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
    (prompt, logits)
}

/// Largest |kiln − transformers| over the prompt's logits, relative to the logits' scale.
fn relative_error(file: &str, family: &str) -> f64 {
    let (prompt, want) = expected(family);
    let options = LoadOptions { dtype: FloatDType::F32, max_positions: Some(128) };
    let (_, model) = load::<B>(&fixtures().join("gguf").join(file), &options, &Default::default()).unwrap_or_else(|e| panic!("{file}: {e}"));
    let got = logits(&model, &prompt);
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    got.iter().zip(&want).map(|(a, b)| (f64::from(*a) - b).abs()).fold(0.0, f64::max) / scale
}

#[test]
fn gguf_logits_match_transformers() {
    // Float files hold the checkpoint's values exactly (llama31's bf16 widened to f32; qwen3's
    // f16 as stored): the f32 bound of the safetensors path.
    for (file, family) in [("llama31.F32.gguf", "llama31"), ("qwen3.F16.gguf", "qwen3")] {
        let err = relative_error(file, family);
        assert!(err < 1e-4, "{file}: relative logit error {err:.3e}");
    }
    // bf16 → f16 could round small weights (these fit); 8-bit and 4-bit blocks (the "Q4_K" files hold
    // Q4_0: the fixtures' rows of 64/96 are too short for k-quants) round every weight. The bounds
    // are about 1.5× what these files gave (their dequantization is bit-exact above, so the error is
    // the format's own): a change in loading that mixes up tensors lands far outside them.
    let mut report = Vec::new();
    for (file, family, bound) in [
        ("llama31.F16.gguf", "llama31", 1e-4),
        ("llama31.Q8_0.gguf", "llama31", 0.045),
        ("qwen2.Q8_0.gguf", "qwen2", 0.045),
        ("qwen3.Q8_0.gguf", "qwen3", 0.045),
        ("mistral.Q8_0.gguf", "mistral", 0.045),
        ("llama31.Q4_K.gguf", "llama31", 0.56),
        ("qwen2.Q4_K.gguf", "qwen2", 0.39),
        ("qwen3.Q4_K.gguf", "qwen3", 0.8),
        ("mistral.Q4_K.gguf", "mistral", 0.42),
    ] {
        let err = relative_error(file, family);
        report.push(format!("{file}: relative logit error {err:.3e} (bound {bound})"));
        assert!(err < bound, "{report:#?}");
    }
    println!("{report:#?}");
}

#[test]
fn gguf_vocabulary_encodes_like_tokenizer_json() {
    let gguf = GgufFile::open(&fixtures().join("gguf/llama31.Q8_0.gguf")).unwrap();
    let from_gguf = Tokenizer::from_gguf(&gguf).unwrap();
    let from_json = Tokenizer::from_file(&fixtures().join("tokenizer/tokenizer.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("tokenizer/expected.json")).unwrap()).unwrap();
    for case in expected["encodings"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = from_json.encode(text, true).unwrap();
        assert_eq!(from_gguf.encode(text, true).unwrap(), ids, "{text:?}");
        assert_eq!(from_gguf.decode(&ids, false).unwrap(), from_json.decode(&ids, false).unwrap());
    }
}
