//! Unit tests of the GGUF parser and the name and layout mapping; `vocabularies` tests the tokenizers
//! built from GGUF vocabularies.

mod vocabularies;

use super::*;
use crate::error::LoadError;

/// A GGUF writer for tests: metadata entries and tensors written as raw bytes.
#[derive(Default)]
struct Writer {
    version: u32,
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    alignment: u64,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Writer {
    fn new() -> Self {
        Self { version: 3, alignment: 32, ..Default::default() }
    }

    /// A raw entry: key, type id and the value's bytes.
    fn raw(mut self, key: &str, ty: u32, value: &[u8]) -> Self {
        string(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    fn u32(self, key: &str, v: u32) -> Self {
        self.raw(key, 4, &v.to_le_bytes())
    }

    fn f32(self, key: &str, v: f32) -> Self {
        self.raw(key, 6, &v.to_le_bytes())
    }

    fn bool(self, key: &str, v: bool) -> Self {
        self.raw(key, 7, &[v as u8])
    }

    fn str(self, key: &str, v: &str) -> Self {
        let mut b = Vec::new();
        string(&mut b, v);
        self.raw(key, 8, &b)
    }

    fn array(self, key: &str, elem: u32, n: u64, body: &[u8]) -> Self {
        let mut b = elem.to_le_bytes().to_vec();
        b.extend(n.to_le_bytes());
        b.extend(body);
        self.raw(key, 9, &b)
    }

    fn str_array(self, key: &str, v: &[&str]) -> Self {
        let mut b = Vec::new();
        for s in v {
            string(&mut b, s);
        }
        self.array(key, 8, v.len() as u64, &b)
    }

    fn f32_array(self, key: &str, v: &[f32]) -> Self {
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.array(key, 6, v.len() as u64, &b)
    }

    fn i32_array(self, key: &str, v: &[i32]) -> Self {
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.array(key, 5, v.len() as u64, &b)
    }

    fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Self {
        self.tensors.push((name.into(), dims.to_vec(), ty.id(), data));
        self
    }

    fn f32_tensor(self, name: &str, dims: &[u64], v: &[f32]) -> Self {
        self.tensor(name, dims, GgmlType::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).next_multiple_of(self.alignment);
        }
        let start = (out.len() as u64).next_multiple_of(self.alignment) as usize;
        out.resize(start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(start + off as usize, 0);
            out.extend(data);
        }
        out
    }

    fn parse(&self) -> Result<GgufFile> {
        GgufFile::from_bytes("test.gguf", self.bytes())
    }
}

fn err_text(r: Result<GgufFile>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn parses_every_value_type() {
    let nested = {
        // [[1u8, 2u8], []]
        let mut b = 0u32.to_le_bytes().to_vec();
        b.extend(2u64.to_le_bytes());
        b.extend([1u8, 2]);
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b
    };
    let w = Writer::new()
        .raw("u8", 0, &[200])
        .raw("i8", 1, &[0xFF])
        .raw("u16", 2, &65535u16.to_le_bytes())
        .raw("i16", 3, &(-2i16).to_le_bytes())
        .u32("u32", 7)
        .raw("i32", 5, &(-5i32).to_le_bytes())
        .f32("f32", 1.5)
        .bool("bool", true)
        .str("str", "héllo")
        .raw("u64", 10, &u64::MAX.to_le_bytes())
        .raw("i64", 11, &(-9i64).to_le_bytes())
        .raw("f64", 12, &0.1f64.to_le_bytes())
        .str_array("strs", &["a", "", "ü"])
        .f32_array("f32s", &[1.0, -2.0])
        .i32_array("i32s", &[3, -1])
        .array("nested", 9, 2, &nested)
        .array("empty", 8, 0, &[]);
    let f = w.parse().unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.get("u8"), Some(&Value::U8(200)));
    assert_eq!(f.get("i8"), Some(&Value::I8(-1)));
    assert_eq!(f.u64("u16").unwrap(), 65535);
    assert_eq!(f.get("i16"), Some(&Value::I16(-2)));
    assert_eq!(f.u64("u32").unwrap(), 7);
    assert_eq!(f.get("i32"), Some(&Value::I32(-5)));
    assert_eq!(f.f64("f32").unwrap(), 1.5);
    assert!(f.bool("bool").unwrap());
    assert_eq!(f.str("str").unwrap(), "héllo");
    assert_eq!(f.u64("u64").unwrap(), u64::MAX);
    assert_eq!(f.get("i64"), Some(&Value::I64(-9)));
    assert_eq!(f.f64("f64").unwrap(), 0.1);
    assert_eq!(f.str_array("strs").unwrap(), &["a", "", "ü"]);
    assert_eq!(f.f32_array("f32s").unwrap(), &[1.0, -2.0]);
    assert_eq!(f.i32_array("i32s").unwrap(), &[3, -1]);
    assert_eq!(f.get("nested"), Some(&Value::Array(Array::Array(vec![Array::U8(vec![1, 2]), Array::U8(vec![])]))));
    assert_eq!(f.str_array("empty").unwrap().len(), 0);
    assert_eq!(f.metadata().count(), 17);
    assert_eq!(f.metadata().next().unwrap().0, "u8");
    assert_eq!(f.alignment(), 32);
    assert!(f.tensors().is_empty());

    // Wrong types and missing keys name the file and the key.
    let e = f.u64("i32").unwrap_err().to_string();
    assert!(e.contains("test.gguf") && e.contains("`i32`") && e.contains("found i32"), "{e}");
    let e = f.str("u8").unwrap_err().to_string();
    assert!(e.contains("`u8`") && e.contains("expected string"), "{e}");
    let e = f.str_array("f32s").unwrap_err().to_string();
    assert!(e.contains("array of f32"), "{e}");
    let e = f.u64("nope").unwrap_err();
    assert!(matches!(&e, LoadError::Field { field, .. } if field == "nope"), "{e}");
    assert_eq!(f.opt_u64("nope").unwrap(), None);
    assert!(f.opt_u64("str").is_err());
    assert_eq!(f.opt_str("str").unwrap(), Some("héllo"));
}

#[test]
fn reads_and_dequantizes_tensors() {
    let q8: Vec<u8> = {
        let mut b = half::f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
        b.extend((0..32).map(|i| i as u8));
        b.repeat(2)
    };
    let mut w = Writer::new().u32("general.alignment", 64);
    w.alignment = 64;
    let f = w
        .f32_tensor("a", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        .tensor("b", &[32, 2], GgmlType::Q8_0, q8.clone())
        .tensor("c", &[2], GgmlType::F16, vec![0x00, 0x3C, 0x00, 0xC0])
        .tensor("d", &[2], GgmlType::BF16, vec![0x80, 0x3F, 0x40, 0xC0])
        .tensor("e", &[256], GgmlType::Q5_K, vec![0; 176])
        .f32_tensor("scalar", &[], &[7.0])
        .parse()
        .unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_start() % 64, 0);
    let names: Vec<_> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c", "d", "e", "scalar"]);
    let a = f.tensor_info("a").unwrap();
    assert_eq!((a.dims.clone(), a.n_elements, a.n_bytes, a.ggml_type), (vec![3, 2], 6, 24, GgmlType::F32));
    assert_eq!(a.shape_row_major(), vec![2, 3]);
    assert_eq!(f.tensor_f32("a").unwrap(), (vec![3, 2], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
    let (dims, b) = f.tensor_f32("b").unwrap();
    assert_eq!(dims, vec![32, 2]);
    assert_eq!(b[..3], [0.0, 0.5, 1.0]);
    assert_eq!(b[32 + 31], 15.5);
    let (ty, dims, raw) = f.tensor_raw("b").unwrap();
    assert_eq!((ty, dims, raw), (GgmlType::Q8_0, &[32usize, 2][..], &q8[..]));
    assert_eq!(f.tensor_f32("c").unwrap().1, vec![1.0, -2.0]);
    assert_eq!(f.tensor_f32("d").unwrap().1, vec![1.0, -3.0]);
    assert_eq!(f.tensor_f32("scalar").unwrap(), (vec![], vec![7.0]));
    // Stored but not dequantizable: raw bytes only.
    assert_eq!(f.tensor_raw("e").unwrap().2.len(), 176);
    let e = f.tensor_f32("e").unwrap_err().to_string();
    assert!(e.contains("`e`") && e.contains("Q5_K"), "{e}");
    let e = f.tensor_f32("zzz").unwrap_err().to_string();
    assert!(e.contains("`zzz`") && e.contains("not in the file"), "{e}");
    assert!(f.contains("a") && !f.contains("zzz"));
}

#[test]
fn open_reads_a_file_and_names_it() {
    let dir = std::env::temp_dir().join(format!("gguf-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    std::fs::write(&path, Writer::new().f32_tensor("w", &[2], &[1.0, 2.0]).bytes()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.path(), path);
    assert_eq!(f.tensor_f32("w").unwrap().1, vec![1.0, 2.0]);
    std::fs::write(&path, b"").unwrap();
    let e = err_text(GgufFile::open(&path));
    assert!(e.contains("m.gguf") && e.contains("truncated"), "{e}");
    let e = err_text(GgufFile::open(&dir.join("missing.gguf")));
    assert!(e.contains("missing.gguf"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rejects_other_versions_and_formats() {
    let mut w = Writer::new();
    w.version = 2;
    assert!(w.parse().is_ok());
    w.version = 1;
    assert!(err_text(w.parse()).contains("version 1 is not supported"));
    w.version = 3u32.swap_bytes();
    assert!(err_text(w.parse()).contains("big-endian"));
    w.version = 4;
    assert!(err_text(w.parse()).contains("unknown GGUF version 4"));
    let mut b = Writer::new().bytes();
    b[0] = b'X';
    assert!(err_text(GgufFile::from_bytes("x", b)).contains("not a GGUF file"));
    for n in 0..24 {
        let e = err_text(GgufFile::from_bytes("short.gguf", Writer::new().bytes()[..n].to_vec()));
        assert!(e.contains("short.gguf") && e.contains("truncated"), "{n}: {e}");
    }
}

fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(n_tensors.to_le_bytes());
    b.extend(n_kv.to_le_bytes());
    b
}

#[test]
fn rejects_counts_the_file_cannot_hold() {
    for (t, k) in [(0, u64::MAX), (u64::MAX, 0), (1 << 40, 0), (0, 1 << 40), (u64::MAX / 24 + 1, 1), (1, 1)] {
        let e = err_text(GgufFile::from_bytes("c.gguf", header(t, k)));
        assert!(e.contains("cannot fit"), "{t} {k}: {e}");
    }
    // Array and string lengths.
    for len in [u64::MAX, 1 << 40, 100] {
        let e = err_text(Writer::new().array("k", 4, len, &[0; 16]).parse());
        assert!(e.contains("`k`") && e.contains("cannot fit"), "{len}: {e}");
        let e = err_text(Writer::new().array("k", 8, len, &[0; 16]).parse());
        assert!(e.contains("`k`") && e.contains("cannot fit"), "{len}: {e}");
        let e = err_text(Writer::new().raw("k", 8, &len.to_le_bytes()).parse());
        assert!(e.contains("`k`") && e.contains("truncated"), "{len}: {e}");
        let mut b = header(0, 1);
        b.extend(len.to_le_bytes());
        b.extend(b"key");
        b.extend([0u8; 16]);
        let e = err_text(GgufFile::from_bytes("c.gguf", b));
        assert!(e.contains("metadata entry 0") && e.contains("truncated"), "{len}: {e}");
    }
}

#[test]
fn rejects_bad_values() {
    let e = err_text(Writer::new().raw("k", 13, &[0; 8]).parse());
    assert!(e.contains("`k`") && e.contains("unknown value type 13"), "{e}");
    let e = err_text(Writer::new().array("k", 99, 1, &[0; 8]).parse());
    assert!(e.contains("unknown array element type 99"), "{e}");
    let e = err_text(Writer::new().raw("k", 7, &[2]).parse());
    assert!(e.contains("bool byte 2"), "{e}");
    let e = err_text(Writer::new().raw("k", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFE]).parse());
    assert!(e.contains("UTF-8"), "{e}");
    let e = err_text(Writer::new().u32("k", 1).u32("k", 2).parse());
    assert!(e.contains("`k`") && e.contains("duplicate key"), "{e}");
    for a in [0u32, 3, 48] {
        let e = err_text(Writer::new().u32("general.alignment", a).parse());
        assert!(e.contains("general.alignment") && e.contains("power of two"), "{a}: {e}");
    }
    let e = err_text(Writer::new().str("general.alignment", "32").parse());
    assert!(e.contains("general.alignment"), "{e}");
    // Nested arrays past the depth limit: [[[...]]] 9 deep.
    let mut body = Vec::new();
    for _ in 0..9 {
        body.extend(9u32.to_le_bytes());
        body.extend(1u64.to_le_bytes());
    }
    body.extend(0u32.to_le_bytes());
    body.extend(0u64.to_le_bytes());
    body.extend([0u8; 64]);
    let e = err_text(Writer::new().raw("deep", 9, &body).parse());
    assert!(e.contains("nested deeper"), "{e}");
}

#[test]
fn rejects_bad_tensor_infos() {
    let ok = || Writer::new().f32_tensor("t", &[2, 2], &[0.0; 4]);
    assert!(ok().parse().is_ok());
    let e = err_text(Writer::new().f32_tensor("t", &[1, 1, 1, 1, 1], &[0.0]).parse());
    assert!(e.contains("`t`") && e.contains("5 dimensions"), "{e}");
    let e = err_text(Writer::new().f32_tensor("t", &[1 << 32, 1 << 32, 1 << 32], &[0.0]).parse());
    assert!(e.contains("`t`") && e.contains("overflow"), "{e}");
    let e = err_text(Writer::new().f32_tensor("t", &[u64::MAX], &[0.0]).parse());
    assert!(e.contains("`t`") && e.contains("too large"), "{e}");
    // Fits in usize but not in the file.
    let e = err_text(Writer::new().f32_tensor("t", &[1 << 40], &[0.0]).parse());
    assert!(e.contains("`t`") && e.contains("past the end"), "{e}");
    let mut w = ok();
    w.tensors[0].2 = 31;
    let e = err_text(w.parse());
    assert!(e.contains("`t`") && e.contains("unknown ggml type id 31"), "{e}");
    let e = err_text(Writer::new().tensor("t", &[16], GgmlType::Q8_0, vec![0; 34]).parse());
    assert!(e.contains("`t`") && e.contains("not a multiple of the Q8_0 block size"), "{e}");
    let e = err_text(Writer::new().tensor("t", &[16, 2], GgmlType::Q4_0, vec![0; 18]).parse());
    assert!(e.contains("block size"), "{e}");
    let e = err_text(ok().f32_tensor("t", &[1], &[0.0]).parse());
    assert!(e.contains("`t`") && e.contains("duplicate tensor name"), "{e}");
    // Offsets: misaligned, past the end, overflowing.
    for (offset, what) in [(4u64, "alignment"), (1 << 20, "past the end"), (u64::MAX - 31, "past the end")] {
        let mut b = ok().bytes();
        let at = 4 + 4 + 8 + 8 + 8 + 1 + 4 + 16 + 4;
        assert_eq!(b[at..at + 8], [0; 8]);
        b[at..at + 8].copy_from_slice(&offset.to_le_bytes());
        let e = err_text(GgufFile::from_bytes("o.gguf", b));
        assert!(e.contains("`t`") && e.contains(what), "{offset}: {e}");
    }
    // Overlapping data.
    let mut b = ok().f32_tensor("u", &[4], &[0.0; 4]).bytes();
    let name_at = b.windows(9).position(|x| x == [1, 0, 0, 0, 0, 0, 0, 0, b'u']).unwrap();
    let off_at = name_at + 9 + 4 + 8 + 4;
    assert_eq!(u64::from_le_bytes(b[off_at..off_at + 8].try_into().unwrap()), 32);
    b[off_at..off_at + 8].copy_from_slice(&0u64.to_le_bytes());
    let e = err_text(GgufFile::from_bytes("o.gguf", b));
    assert!(e.contains("`u`") && e.contains("overlaps") && e.contains("`t`"), "{e}");
    // Truncated data.
    let b = ok().bytes();
    let e = err_text(GgufFile::from_bytes("o.gguf", b[..b.len() - 1].to_vec()));
    assert!(e.contains("`t`") && e.contains("past the end"), "{e}");
    // A zero-sized tensor is fine, even at the very end.
    let f = Writer::new().f32_tensor("z", &[0, 3], &[]).parse().unwrap();
    assert_eq!(f.tensor_f32("z").unwrap(), (vec![0, 3], vec![]));
}

#[test]
fn decoder_fields_from_llama_metadata() {
    let w = Writer::new()
        .str("general.architecture", "llama")
        .u32("llama.context_length", 128)
        .u32("llama.embedding_length", 64)
        .u32("llama.block_count", 2)
        .u32("llama.feed_forward_length", 96)
        .u32("llama.attention.head_count", 4)
        .u32("llama.attention.head_count_kv", 2)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .f32("llama.rope.freq_base", 500000.0)
        .u32("llama.rope.dimension_count", 16)
        .str("llama.rope.scaling.type", "linear")
        .f32("llama.rope.scaling.factor", 2.0)
        .str("llama.hidden_activation", "silu")
        .u32("tokenizer.ggml.bos_token_id", 0)
        .str_array("tokenizer.ggml.tokens", &["a", "b", "c"])
        .f32_tensor("rope_freqs.weight", &[8], &[1.0; 8]);
    let info = w.parse().unwrap().decoder_fields().unwrap();
    assert_eq!(
        info,
        GgufModelInfo {
            architecture: "llama".into(),
            context_length: 128,
            embedding_length: 64,
            block_count: 2,
            feed_forward_length: 96,
            head_count: 4,
            head_count_kv: 2,
            rms_norm_eps: 1e-5f32 as f64,
            rope_freq_base: 500000.0,
            key_length: None,
            value_length: None,
            head_dim: 16,
            rope_dimension_count: Some(16),
            rope_scaling: Some(RopeScaling { kind: "linear".into(), factor: Some(2.0), original_context_length: None }),
            sliding_window: None,
            hidden_activation: Some("silu".into()),
            vocab_size: 3,
            bos_token_id: Some(0),
            eos_token_id: None,
            tied_embeddings: true,
            has_rope_freqs: true,
        }
    );

    let w = Writer::new()
        .str("general.architecture", "qwen3")
        .u32("qwen3.context_length", 128)
        .u32("qwen3.embedding_length", 64)
        .u32("qwen3.block_count", 2)
        .u32("qwen3.feed_forward_length", 96)
        .i32_array("qwen3.attention.head_count", &[4, 4])
        .u32("qwen3.attention.key_length", 24)
        .f32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
        .u32("qwen3.vocab_size", 320)
        .f32_tensor("output.weight", &[1], &[0.0]);
    let info = w.parse().unwrap().decoder_fields().unwrap();
    assert_eq!((info.head_count, info.head_count_kv, info.head_dim, info.vocab_size), (4, 4, 24, 320));
    assert_eq!((info.rope_freq_base, info.tied_embeddings, info.rope_scaling), (10000.0, false, None));

    let e = Writer::new().str("general.architecture", "llama").parse().unwrap().decoder_fields().unwrap_err();
    assert!(e.to_string().contains("llama.attention.head_count"), "{e}");
    let e = Writer::new()
        .str("general.architecture", "x")
        .i32_array("x.attention.head_count", &[4, 8])
        .parse()
        .unwrap()
        .decoder_fields()
        .unwrap_err();
    assert!(e.to_string().contains("differs between layers"), "{e}");
}

#[test]
fn hf_names_map_to_gguf_names() {
    let cases = [
        ("model.embed_tokens.weight", Some("token_embd.weight")),
        ("model.norm.weight", Some("output_norm.weight")),
        ("lm_head.weight", Some("output.weight")),
        ("model.layers.0.input_layernorm.weight", Some("blk.0.attn_norm.weight")),
        ("model.layers.12.post_attention_layernorm.weight", Some("blk.12.ffn_norm.weight")),
        ("model.layers.3.self_attn.q_proj.weight", Some("blk.3.attn_q.weight")),
        ("model.layers.3.self_attn.k_proj.bias", Some("blk.3.attn_k.bias")),
        ("model.layers.3.self_attn.v_proj.bias", Some("blk.3.attn_v.bias")),
        ("model.layers.3.self_attn.o_proj.weight", Some("blk.3.attn_output.weight")),
        ("model.layers.1.self_attn.q_norm.weight", Some("blk.1.attn_q_norm.weight")),
        ("model.layers.1.self_attn.k_norm.weight", Some("blk.1.attn_k_norm.weight")),
        ("model.layers.1.self_attn.attn_sub_norm.weight", Some("blk.1.attn_sub_norm.weight")),
        ("model.layers.0.mlp.ffn_sub_norm.weight", Some("blk.0.ffn_sub_norm.weight")),
        ("model.layers.0.mlp.ffn_sub_norm.bias", None),
        ("model.layers.1.mlp.gate_proj.weight", Some("blk.1.ffn_gate.weight")),
        ("model.layers.1.mlp.up_proj.weight", Some("blk.1.ffn_up.weight")),
        ("model.layers.1.mlp.down_proj.bias", Some("blk.1.ffn_down.bias")),
        ("model.layers.1.input_layernorm.bias", None),
        ("model.layers.1.self_attn.q_norm.bias", None),
        ("model.layers.x.mlp.up_proj.weight", None),
        ("model.layers.01.mlp.up_proj.weight", None),
        ("model.layers..mlp.up_proj.weight", None),
        ("model.layers.1.mlp.up_proj.scale", None),
        ("model.layers.1.mlp.other.weight", None),
        ("model.layers.1", None),
        ("something.else", None),
    ];
    for (hf, gguf) in cases {
        assert_eq!(gguf_tensor_name(hf).as_deref(), gguf, "{hf}");
    }
}

/// llama.cpp's `LlamaModel.permute`: rows reshaped to `[n_head, 2, hd/2]`, the last two axes swapped.
fn permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let (hd, half) = (rows / n_head, rows / n_head / 2);
    let mut out = vec![0.0; w.len()];
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let src = h * hd + j * half + i; // index [h, j, i] before the swap
                let dst = h * hd + i * 2 + j; // index [h, i, j] after
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[test]
fn unpermute_inverts_the_converters_permute() {
    for (rows, cols, n_head) in [(64, 64, 4), (32, 64, 2), (48, 8, 3), (16, 1, 4), (2, 5, 1)] {
        let w: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let p = permute(&w, rows, cols, n_head);
        if rows > 2 {
            assert_ne!(p, w);
        }
        assert_eq!(unpermute_qk(&p, rows, cols, n_head).unwrap(), w, "{rows}x{cols}/{n_head}");
    }
    // Head 0 of hd 4: stored rows [0, 2, 1, 3] of HF.
    let p = permute(&[0.0, 1.0, 2.0, 3.0], 4, 1, 1);
    assert_eq!(p, vec![0.0, 2.0, 1.0, 3.0]);
    // Whole rows of bytes move the same way (quantized rows).
    let bytes: Vec<u8> = (0..8u8).collect();
    assert_eq!(unpermute_qk(&bytes, 4, 2, 1).unwrap(), vec![0, 1, 4, 5, 2, 3, 6, 7]);
    assert!(unpermute_qk(&[0.0; 12], 6, 2, 2).is_none());
    assert!(unpermute_qk(&[0.0; 8], 4, 2, 0).is_none());
    assert!(unpermute_qk(&[0.0; 7], 4, 2, 1).is_none());
    assert!(unpermute_qk(&[0.0; 8], usize::MAX, 2, 1).is_none());
}
