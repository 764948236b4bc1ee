//! HF `BitNetForCausalLM` checkpoints: tiny random models that transformers saved with packed
//! ternary linears (`tests/fixtures/make_bitnet.py` on the GPU machine; `bitlinear` and
//! `autobitlinear` scale conventions) load with `load_bitnet` and give transformers' logits (f32
//! on the GPU there) and its greedy tokens; damaged packed tensors give errors naming them.
//!
//! Logits are a step function of the activations here: each linear rounds its input to 8 bits, so
//! two correct paths whose RMSNorm outputs differ in the last bit could round an activation to the
//! neighbouring code (about 1e-3 of the logits' scale). On these fixtures no path does: every
//! path (f64 and f32 reference ops, wgpu kernels) is within 4e-7 of transformers' f32 logits,
//! relative to their largest, so the bound is f32 rounding's, 1e-5.

#[path = "../../tests/common/mod.rs"]
mod common;
mod support;

use std::path::Path;

use burn::backend::NdArray;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use kiln_models::{GenerationConfig, LoadOptions, TernaryDecoder, generation::collect_tokens, load, load_bitnet};
use safetensors::{Dtype, SafeTensors};
use support::{damaged, fixture, max_abs_err};

const VARIANTS: [&str; 2] = ["bitnet", "bitnet_auto"];
/// Largest logit error relative to the largest logit (see the module doc).
const TOLERANCE: f64 = 1e-5;

fn options(dtype: FloatDType) -> LoadOptions {
    LoadOptions { dtype, max_positions: Some(64) }
}

/// The prompt, transformers' f32 logits and its greedy continuation.
fn expected(name: &str) -> (Vec<i64>, Vec<f64>, Vec<u32>) {
    let bytes = std::fs::read(fixture(name).join("expected.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let ints = |n: &str| file.tensor(n).unwrap().data().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    let logits = file.tensor("logits").unwrap().data().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect();
    let greedy = ints("greedy").into_iter().map(|t| t as u32).collect();
    (ints("prompt"), logits, greedy)
}

fn model<B: kiln::KilnBackend>(dir: &Path, dtype: FloatDType, device: &B::Device) -> TernaryDecoder<B> {
    load_bitnet::<B>(dir, &options(dtype), device).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).1
}

fn logits<B: kiln::KilnBackend>(model: &TernaryDecoder<B>, prompt: &[i64], device: &B::Device) -> Vec<f64> {
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(prompt.to_vec(), [1, prompt.len()]), device);
    common::values(model.forward(tokens))
}

fn greedy<B: kiln::KilnBackend>(model: &TernaryDecoder<B>, prompt: &[i64], new: usize) -> Vec<u32> {
    let prompt: Vec<u32> = prompt.iter().map(|&t| t as u32).collect();
    let config = GenerationConfig { max_new_tokens: new, ..GenerationConfig::default() };
    collect_tokens(model.generate(std::slice::from_ref(&prompt), config), 1).remove(0)
}

/// Logits of the checkpoint at `path` within f32 rounding of transformers' for fixture `name`
/// (see the module doc), and the same greedy tokens (with the KV cache; transformers ran full
/// forwards).
fn check<B: kiln::KilnBackend>(name: &str, path: &Path, backend: &str, dtype: FloatDType, device: &B::Device) -> f64 {
    let (prompt, expected, tokens) = expected(name);
    let model = model::<B>(path, dtype, device);
    let got = logits(&model, &prompt, device);
    let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let err = max_abs_err(&got, &expected);
    let file = path.file_name().unwrap().to_string_lossy();
    assert!(err <= TOLERANCE * scale, "{backend} {file}: logits differ from transformers by {err:.3e} (scale {scale:.2})");
    assert_eq!(greedy(&model, &prompt, tokens.len()), tokens, "{backend} {file}: greedy tokens");
    err / scale
}

#[test]
fn bitnet_checkpoints_give_transformers_logits() {
    let cpu = Default::default();
    for name in VARIANTS {
        let f64_err = check::<NdArray<f64>>(name, &fixture(name), "ndarray f64", FloatDType::F64, &cpu);
        let f32_err = check::<NdArray<f32>>(name, &fixture(name), "ndarray f32", FloatDType::F32, &cpu);
        eprintln!("{name}: relative logit error ndarray f64 {f64_err:.2e}, f32 {f32_err:.2e}");
        #[cfg(feature = "wgpu")]
        if let Some(gpu) = common::wgpu_device() {
            let err = check::<burn::backend::Wgpu>(name, &fixture(name), "wgpu", FloatDType::F32, &gpu);
            eprintln!("{name}: relative logit error wgpu {err:.2e}");
        }
    }
}

/// llama.cpp's `bitnet` GGUFs of the `autobitlinear` fixture (`fixtures/make_gguf.py`): weights
/// as the converter writes them (`codes · weight_scale` floats) or as codes with a `.scale`
/// tensor. Both pack to the ternary weights transformers ran: its logits and greedy tokens.
const GGUFS: [&str; 2] = ["gguf/bitnet_auto.F32.gguf", "gguf/bitnet_auto.F16_scale.gguf"];

#[test]
fn bitnet_ggufs_give_transformers_logits() {
    let cpu = Default::default();
    for file in GGUFS {
        let err = check::<NdArray<f32>>("bitnet_auto", &fixture(file), "ndarray f32", FloatDType::F32, &cpu);
        eprintln!("{file}: relative logit error ndarray f32 {err:.2e}");
    }
}

/// A float load of a `bitnet` GGUF computes what llama.cpp does with it: the sub-norms, squared
/// ReLU and the `.scale`s, in float (no 8-bit activations). Its logits stay within the 8-bit
/// activations' rounding of the packed decoder's; a dropped `.scale` or sub-norm lands far outside.
#[test]
fn bitnet_gguf_loads_as_float() {
    let cpu = Default::default();
    let (prompt, ..) = expected("bitnet_auto");
    let packed = logits(&model::<NdArray>(&fixture(GGUFS[1]), FloatDType::F32, &cpu), &prompt, &cpu);
    let (_, float) = load::<NdArray>(&fixture(GGUFS[1]), &options(FloatDType::F32), &cpu).unwrap();
    let tokens = Tensor::<NdArray, 2, Int>::from_data(TensorData::new(prompt.clone(), [1, prompt.len()]), &cpu);
    let float = common::values(float.forward(tokens));
    let scale = packed.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let err = max_abs_err(&packed, &float) / scale;
    eprintln!("bitnet GGUF as float: {err:.2e} of the logits' scale from the packed decoder");
    assert!(err < 0.05, "float and packed loads differ by {err:.3e} of the logits' scale");
}

/// A copy of fixture GGUF `file` with the values `from` (found once in the file, as f32 bytes)
/// replaced by `to`.
fn patched_gguf(file: &str, tag: &str, from: &[f32], to: &[f32]) -> std::path::PathBuf {
    let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (from, to) = (le(from), le(to));
    let mut bytes = std::fs::read(fixture(file)).unwrap();
    let at: Vec<usize> = bytes.windows(from.len()).enumerate().filter(|(_, w)| *w == from).map(|(i, _)| i).collect();
    assert_eq!(at.len(), 1, "the values are not unique in {file}");
    bytes[at[0]..at[0] + to.len()].copy_from_slice(&to);
    let path = std::env::temp_dir().join(format!("kiln-bitnet-{tag}-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn damaged_bitnet_ggufs_are_named() {
    let weight = "blk.1.attn_q.weight";
    let gguf = kiln_models::gguf::GgufFile::open(&fixture(GGUFS[0])).unwrap();
    // A fourth level in a row: no ternary weight. (The tensor's first 64 values find it.)
    let head = gguf.tensor_f32(weight).unwrap().1[..64].to_vec();
    let mut halved = head.clone();
    *halved.iter_mut().find(|v| **v > 0.0).unwrap() *= 0.5;
    let path = patched_gguf(GGUFS[0], "level", &head, &halved);
    let msg = load_error(&path);
    assert!(msg.contains(weight) && msg.contains("magnitudes"), "{msg}");
    // A zero scale would make every product zero.
    let scale = kiln_models::gguf::GgufFile::open(&fixture(GGUFS[1])).unwrap().tensor_f32("blk.1.attn_q.scale").unwrap().1[0];
    let path = patched_gguf(GGUFS[1], "scale", &[scale], &[0.0]);
    let msg = load_error(&path);
    assert!(msg.contains("blk.1.attn_q.scale") && msg.contains("nonzero"), "{msg}");
}

/// The two scale conventions store reciprocal scales of one model: the same logits. Reading one
/// with the other's convention moves them by orders of magnitude more than the tolerance above.
#[test]
fn scale_conventions_agree_and_matter() {
    let cpu = Default::default();
    let (prompt, ..) = expected("bitnet");
    let divide = logits(&model::<NdArray>(&fixture("bitnet"), FloatDType::F32, &cpu), &prompt, &cpu);
    let multiply = logits(&model::<NdArray>(&fixture("bitnet_auto"), FloatDType::F32, &cpu), &prompt, &cpu);
    let scale = divide.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(max_abs_err(&divide, &multiply) <= TOLERANCE * scale);
    let swapped = damaged(&fixture("bitnet"), "bitnet-convention", |_| {});
    let config = std::fs::read_to_string(swapped.join("config.json")).unwrap().replace("\"bitlinear\"", "\"autobitlinear\"");
    std::fs::write(swapped.join("config.json"), config).unwrap();
    let wrong = logits(&model::<NdArray>(&swapped, FloatDType::F32, &cpu), &prompt, &cpu);
    assert!(max_abs_err(&divide, &wrong) > 0.3 * scale, "the weight scale convention changed nothing");
}

fn load_error(dir: &Path) -> String {
    match load_bitnet::<NdArray>(dir, &options(FloatDType::F32), &Default::default()) {
        Ok(_) => panic!("{}: loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn damaged_packed_tensors_are_named() {
    let src = fixture("bitnet");
    let q = "model.layers.1.self_attn.q_proj.weight";
    let edit = |tag: &str, f: &dyn Fn(&mut support::StoredTensor)| {
        damaged(&src, &format!("bitnet-{tag}"), |t| t.iter_mut().filter(|x| x.0.starts_with(q)).for_each(f))
    };
    let nan = edit("nan", &|t| {
        if t.0.ends_with("weight_scale") {
            t.3 = f32::NAN.to_le_bytes().to_vec();
        }
    });
    let msg = load_error(&nan);
    assert!(msg.contains(&format!("{q}_scale")) && msg.contains("positive finite"), "{msg}");
    let code3 = edit("code3", &|t| {
        if t.0 == q {
            t.3[5] = 0xff;
        }
    });
    let msg = load_error(&code3);
    assert!(msg.contains(q) && msg.contains("code 3"), "{msg}");
    let float = edit("float", &|t| {
        if t.0 == q {
            t.1 = Dtype::F32;
            t.2 = vec![t.2[0], t.2[1] / 4];
        }
    });
    let msg = load_error(&float);
    assert!(msg.contains(q) && msg.contains("U8"), "{msg}");
    let missing = damaged(&src, "bitnet-missing", |t| t.retain(|x| x.0 != format!("{q}_scale")));
    let msg = load_error(&missing);
    assert!(msg.contains(q), "{msg}");
    let config = std::fs::read_to_string(src.join("config.json")).unwrap().replace("\"bitlinear\"", "\"trilinear\"");
    std::fs::write(missing.join("config.json"), config).unwrap();
    let msg = load_error(&missing);
    assert!(msg.contains("quantization_config.linear_class") && msg.contains("trilinear"), "{msg}");
    let as_float = load::<NdArray>(&src, &options(FloatDType::F32), &Default::default()).map(|_| ()).unwrap_err().to_string();
    assert!(as_float.contains("load_bitnet") && as_float.contains("weight_scale"), "{as_float}");
}
