//! The GGUF reader on damaged and hostile files: a small valid file is written, checked, then
//! truncated at every byte of its header, metadata and tensor infos (and at points in its data),
//! mutated at random (seeded), and its counts, lengths, type tags, dims and offsets set to extreme
//! values. Every case must give `Ok` or `Err` from `GgufFile::open`/`from_bytes`, `tensor_f32`,
//! `decoder_fields` and `tokenizer`, never a panic.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use kiln_models::gguf::{GgmlType, GgufFile};

// --- A GGUF writer that remembers where each count, length, tag and offset is ------------------

enum Val {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    /// Element type id and elements (all of that type).
    Arr(u32, Vec<Val>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Val {
    fn type_id(&self) -> u32 {
        match self {
            Val::U8(_) => 0,
            Val::I8(_) => 1,
            Val::U16(_) => 2,
            Val::I16(_) => 3,
            Val::U32(_) => 4,
            Val::I32(_) => 5,
            Val::F32(_) => 6,
            Val::Bool(_) => 7,
            Val::Str(_) => 8,
            Val::Arr(..) => 9,
            Val::U64(_) => 10,
            Val::I64(_) => 11,
            Val::F64(_) => 12,
        }
    }

    fn strs(v: &[&str]) -> Val {
        Val::Arr(8, v.iter().map(|s| Val::Str(s.to_string())).collect())
    }
}

/// A field of the layout: what it is, where, and its width in bytes (4 or 8).
#[derive(Clone)]
struct Field {
    what: String,
    at: usize,
    width: usize,
}

#[derive(Default)]
struct Out {
    buf: Vec<u8>,
    fields: Vec<Field>,
}

impl Out {
    fn u32(&mut self, what: impl Into<String>, v: u32) {
        self.fields.push(Field { what: what.into(), at: self.buf.len(), width: 4 });
        self.buf.extend(v.to_le_bytes());
    }

    fn u64(&mut self, what: impl Into<String>, v: u64) {
        self.fields.push(Field { what: what.into(), at: self.buf.len(), width: 8 });
        self.buf.extend(v.to_le_bytes());
    }

    fn string(&mut self, what: &str, s: &str) {
        self.u64(format!("{what} length"), s.len() as u64);
        self.buf.extend(s.as_bytes());
    }

    fn value(&mut self, what: &str, v: &Val) {
        match v {
            Val::U8(x) => self.buf.push(*x),
            Val::I8(x) => self.buf.push(*x as u8),
            Val::U16(x) => self.buf.extend(x.to_le_bytes()),
            Val::I16(x) => self.buf.extend(x.to_le_bytes()),
            Val::U32(x) => self.buf.extend(x.to_le_bytes()),
            Val::I32(x) => self.buf.extend(x.to_le_bytes()),
            Val::F32(x) => self.buf.extend(x.to_le_bytes()),
            Val::Bool(x) => self.buf.push(*x as u8),
            Val::Str(s) => self.string(what, s),
            Val::Arr(ty, items) => {
                self.u32(format!("{what} element type"), *ty);
                self.u64(format!("{what} array length"), items.len() as u64);
                // Elements carry no type tag (a nested array starts with its own element type).
                for (i, item) in items.iter().enumerate() {
                    self.value(&format!("{what}[{i}]"), item);
                }
            }
            Val::U64(x) => self.buf.extend(x.to_le_bytes()),
            Val::I64(x) => self.buf.extend(x.to_le_bytes()),
            Val::F64(x) => self.buf.extend(x.to_le_bytes()),
        }
    }
}

struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// The written file and where things are in it.
struct Written {
    bytes: Vec<u8>,
    fields: Vec<Field>,
    /// Where the data section starts (the end of the header, metadata and tensor infos, padded).
    data_start: usize,
    /// Where the last tensor's data ends.
    data_end: usize,
}

fn write_gguf(version: u32, kvs: &[(&str, Val)], tensors: &[Tensor], alignment: usize) -> Written {
    let mut o = Out::default();
    o.buf.extend(b"GGUF");
    o.u32("version", version);
    o.u64("tensor count", tensors.len() as u64);
    o.u64("metadata count", kvs.len() as u64);
    for (key, v) in kvs {
        o.string(&format!("key {key}"), key);
        o.u32(format!("{key} value type"), v.type_id());
        o.value(key, v);
    }
    let mut offset = 0usize;
    let mut offsets = Vec::new();
    for t in tensors {
        o.string(&format!("tensor {} name", t.name), &t.name);
        o.u32(format!("tensor {} n_dims", t.name), t.dims.len() as u32);
        for (i, d) in t.dims.iter().enumerate() {
            o.u64(format!("tensor {} dim {i}", t.name), *d);
        }
        o.u32(format!("tensor {} type", t.name), t.ty.id());
        o.u64(format!("tensor {} offset", t.name), offset as u64);
        offsets.push(offset);
        offset = (offset + t.data.len()).next_multiple_of(alignment);
    }
    let data_start = o.buf.len().next_multiple_of(alignment);
    o.buf.resize(data_start, 0);
    let mut data_end = data_start;
    for (t, off) in tensors.iter().zip(offsets) {
        o.buf.resize(data_start + off, 0);
        o.buf.extend(&t.data);
        data_end = o.buf.len();
    }
    Written { bytes: o.buf, fields: o.fields, data_start, data_end }
}

/// `x` as an IEEE half (for normal values that a half holds exactly).
fn f16(x: f32) -> [u8; 2] {
    let b = x.to_bits();
    let exp = ((b >> 23) & 0xFF) as i32 - 127 + 15;
    assert!((1..31).contains(&exp) && b & 0x1FFF == 0, "{x} is not exact in f16");
    (((b >> 16) & 0x8000) as u16 | (exp as u16) << 10 | ((b >> 13) & 0x3FF) as u16).to_le_bytes()
}

/// A small valid model file: decoder metadata, a byte-level BPE vocabulary, and one tensor of
/// each supported type.
fn valid_file() -> Written {
    let kvs = vec![
        ("general.architecture", Val::Str("llama".into())),
        ("general.alignment", Val::U32(32)),
        ("llama.context_length", Val::U32(128)),
        ("llama.embedding_length", Val::U32(64)),
        ("llama.block_count", Val::U32(1)),
        ("llama.feed_forward_length", Val::U32(96)),
        ("llama.attention.head_count", Val::U32(4)),
        ("llama.attention.head_count_kv", Val::U32(2)),
        ("llama.attention.layer_norm_rms_epsilon", Val::F32(1e-5)),
        ("llama.rope.freq_base", Val::F32(10000.0)),
        ("llama.rope.scaling.type", Val::Str("linear".into())),
        ("llama.rope.scaling.factor", Val::F64(2.0)),
        ("tokenizer.ggml.model", Val::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Val::Str("llama-bpe".into())),
        ("tokenizer.ggml.tokens", Val::strs(&["<s>", "a", "b", "ab", "Ġ", "Ġa"])),
        ("tokenizer.ggml.token_type", Val::Arr(5, [3, 1, 1, 1, 1, 1].into_iter().map(Val::I32).collect())),
        ("tokenizer.ggml.merges", Val::strs(&["a b", "Ġ a"])),
        ("tokenizer.ggml.bos_token_id", Val::U32(0)),
        ("tokenizer.ggml.add_bos_token", Val::Bool(true)),
        // The other value types.
        ("x.u8", Val::U8(1)),
        ("x.i8", Val::I8(-1)),
        ("x.u16", Val::U16(2)),
        ("x.i16", Val::I16(-2)),
        ("x.u64", Val::U64(3)),
        ("x.i64", Val::I64(-3)),
        (
            "x.nested",
            Val::Arr(9, vec![Val::Arr(0, vec![Val::U8(1), Val::U8(2)]), Val::Arr(8, vec![Val::Str("s".into())])]),
        ),
        ("x.f32s", Val::Arr(6, vec![Val::F32(0.5), Val::F32(-0.5)])),
    ];
    let mut q8 = f16(0.5).to_vec();
    q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
    let mut q4 = f16(2.0).to_vec();
    q4.extend([0x98u8; 16]); // low nibble 8 -> 0, high nibble 9 -> 2
    // Q4_K: d = 1, dmin = 0.5, all scales 1 and mins 2; nibbles 1 (low) and 2 (high).
    let mut q4k = f16(1.0).to_vec();
    q4k.extend(f16(0.5));
    q4k.extend([1, 1, 1, 1, 2, 2, 2, 2, 0x21, 0x21, 0x21, 0x21]);
    q4k.extend([0x21u8; 128]);
    // Q6_K: all codes 33 (q = 1), scales 3, d = 0.25.
    let mut q6k = vec![0x11u8; 128];
    q6k.extend([0xAAu8; 64]);
    q6k.extend([3u8; 16]);
    q6k.extend(f16(0.25));
    let tensors = vec![
        Tensor {
            name: "f32".into(),
            dims: vec![3, 2],
            ty: GgmlType::F32,
            data: [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().flat_map(|x| x.to_le_bytes()).collect(),
        },
        Tensor { name: "f16".into(), dims: vec![2], ty: GgmlType::F16, data: [f16(1.5), f16(-2.0)].concat() },
        Tensor { name: "bf16".into(), dims: vec![2], ty: GgmlType::BF16, data: vec![0x80, 0x3F, 0x40, 0xC0] },
        Tensor { name: "q8_0".into(), dims: vec![32, 1], ty: GgmlType::Q8_0, data: q8 },
        Tensor { name: "q4_0".into(), dims: vec![32], ty: GgmlType::Q4_0, data: q4 },
        Tensor { name: "q4_k".into(), dims: vec![256], ty: GgmlType::Q4_K, data: q4k },
        Tensor { name: "q6_k".into(), dims: vec![256, 1, 1, 1], ty: GgmlType::Q6_K, data: q6k },
    ];
    write_gguf(3, &kvs, &tensors, 32)
}

// --- Running a case ----------------------------------------------------------------------------

/// Parses `bytes` and reads everything; `Ok(true)` if the file parsed. A panic becomes `Err` with
/// its message.
fn exercise(bytes: Vec<u8>, tokenize: bool) -> Result<bool, String> {
    let run = move || {
        let Ok(f) = GgufFile::from_bytes("case.gguf", bytes) else { return false };
        read_all(&f, tokenize);
        true
    };
    catch_unwind(AssertUnwindSafe(run)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// Reads every tensor and value; builds the tokenizer if `tokenize` (the slow part, so the cases
/// that cannot change it skip it).
fn read_all(f: &GgufFile, tokenize: bool) {
    for t in f.tensors() {
        if let Ok((dims, values)) = f.tensor_f32(&t.name) {
            assert_eq!(dims, t.dims);
            assert_eq!(values.len(), t.n_elements);
        }
        let _ = f.tensor_raw(&t.name);
    }
    let _ = f.decoder_fields();
    for (k, _) in f.metadata() {
        let _ = (f.u64(k), f.f64(k), f.str(k), f.str_array(k), f.f32_array(k), f.i32_array(k), f.bool(k));
    }
    if !tokenize {
        return;
    }
    if let Ok(tok) = f.tokenizer()
        && let Ok(enc) = tok.encode("ab a<s>b", true)
    {
        let _ = tok.decode(enc.get_ids(), false);
    }
}

fn check(case: &str, bytes: Vec<u8>) -> bool {
    check_with(case, bytes, true)
}

fn check_with(case: &str, bytes: Vec<u8>, tokenize: bool) -> bool {
    match exercise(bytes, tokenize) {
        Ok(parsed) => parsed,
        Err(panic) => panic!("panicked on {case}: {panic}"),
    }
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-gguf-robustness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

// --- Tests -------------------------------------------------------------------------------------

#[test]
fn valid_file_parses_and_dequantizes() {
    let w = valid_file();
    let path = temp_dir().join("valid.gguf");
    std::fs::write(&path, &w.bytes).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let _ = std::fs::remove_file(&path); // the mapping stays valid
    assert_eq!(f.version(), 3);
    assert_eq!(f.data_start(), w.data_start);
    assert_eq!(f.tensors().len(), 7);
    assert_eq!(f.tensor_f32("f32").unwrap(), (vec![3, 2], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
    assert_eq!(f.tensor_f32("f16").unwrap().1, vec![1.5, -2.0]);
    assert_eq!(f.tensor_f32("bf16").unwrap().1, vec![1.0, -3.0]);
    let q8 = f.tensor_f32("q8_0").unwrap().1;
    assert_eq!(q8, (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect::<Vec<_>>());
    let q4 = f.tensor_f32("q4_0").unwrap().1;
    assert_eq!(q4, [vec![0.0; 16], vec![2.0; 16]].concat());
    // Q4_K: 1 * 1 * q - 0.5 * 2 → 0 (low nibbles, even sub-blocks) and 1 (high nibbles, odd).
    let q4k = f.tensor_f32("q4_k").unwrap().1;
    for (i, v) in q4k.iter().enumerate() {
        assert_eq!(*v, if (i / 32) % 2 == 0 { 0.0 } else { 1.0 }, "q4_k value {i}");
    }
    // Q6_K: code 0b10_0001 = 33 → (33 - 32) * 3 * 0.25.
    let (dims, q6k) = f.tensor_f32("q6_k").unwrap();
    assert_eq!(dims, vec![256, 1, 1, 1]);
    assert!(q6k.iter().all(|&v| v == 0.75), "{q6k:?}");
    let (ty, _, raw) = f.tensor_raw("q6_k").unwrap();
    assert_eq!((ty, raw.len()), (GgmlType::Q6_K, 210));

    let info = f.decoder_fields().unwrap();
    assert_eq!((info.architecture.as_str(), info.head_count, info.head_count_kv, info.head_dim), ("llama", 4, 2, 16));
    assert_eq!((info.vocab_size, info.rope_scaling.as_ref().unwrap().factor), (6, Some(2.0)));
    assert_eq!(f.str_array("tokenizer.ggml.tokens").unwrap().len(), 6);
    assert_eq!(f.f32_array("x.f32s").unwrap(), &[0.5, -0.5]);
    let tok = f.tokenizer().unwrap();
    assert_eq!(tok.encode("ab a", true).unwrap().get_ids(), &[0, 3, 5]);
    assert!(check("the valid file", w.bytes.clone()));
}

#[test]
fn truncation_at_every_header_byte_and_in_the_data() {
    let w = valid_file();
    let mut cuts: Vec<usize> = (0..=w.data_start).collect();
    cuts.extend((w.data_start..w.data_end).step_by(7));
    cuts.push(w.data_end - 1);
    for cut in cuts {
        let parsed = check(&format!("truncation at {cut} of {}", w.bytes.len()), w.bytes[..cut].to_vec());
        assert!(!parsed, "a file truncated at {cut} (data ends at {}) parsed", w.data_end);
    }
    assert!(check("the whole file", w.bytes[..w.data_end].to_vec()));

    // The same through the file system, at a few points.
    let dir = temp_dir();
    for cut in [0, 3, 4, 8, 16, 24, 40, w.data_start / 2, w.data_start, w.data_end - 1] {
        let path = dir.join(format!("cut{cut}.gguf"));
        std::fs::write(&path, &w.bytes[..cut]).unwrap();
        let r = catch_unwind(|| GgufFile::open(&path).map(|f| read_all(&f, true)));
        let _ = std::fs::remove_file(&path);
        match r {
            Ok(Ok(())) => panic!("a file truncated at {cut} opened"),
            Ok(Err(e)) => {
                assert!(e.to_string().contains(&format!("cut{cut}.gguf")), "error does not name the file: {e}")
            }
            Err(_) => panic!("panicked opening a file truncated at {cut}"),
        }
    }
}

#[test]
fn extreme_values_in_every_count_length_tag_and_offset() {
    let w = valid_file();
    let len = w.bytes.len() as u64;
    let mut cases = 0;
    for field in &w.fields {
        let at = field.at;
        let orig = if field.width == 4 {
            u32::from_le_bytes(w.bytes[at..at + 4].try_into().unwrap()) as u64
        } else {
            u64::from_le_bytes(w.bytes[at..at + 8].try_into().unwrap())
        };
        let mut values = vec![
            0,
            1,
            2,
            3,
            4,
            5,
            7,
            8,
            9,
            12,
            13,
            14,
            31,
            32,
            33,
            255,
            1 << 16,
            (1 << 31) - 1,
            1 << 31,
            u32::MAX as u64,
            orig.wrapping_add(1),
            orig.wrapping_sub(1),
            orig.wrapping_mul(2),
            orig.wrapping_add(32),
        ];
        if field.width == 8 {
            values.extend([1 << 32, 1 << 40, 1 << 62, i64::MAX as u64, u64::MAX, u64::MAX - 1, len, len + 1, len * 4]);
        }
        for v in values {
            let mut b = w.bytes.clone();
            if field.width == 4 {
                b[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
            } else {
                b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }
            // Only the header counts and the tokenizer's own entries can change the tokenizer.
            let tokenize = field.what.contains("tokenizer.") || field.at < 24;
            check_with(&format!("{} (at byte {at}) set to {v:#x}", field.what), b, tokenize);
            cases += 1;
        }
    }
    assert!(cases > 1000, "{cases}");

    // Wrong tags: every value type id written where a type is expected, and a tensor type that
    // is known but has another block size.
    for field in w.fields.iter().filter(|f| f.what.ends_with("type")) {
        for ty in 0..=40u32 {
            let mut b = w.bytes.clone();
            b[field.at..field.at + 4].copy_from_slice(&ty.to_le_bytes());
            check_with(&format!("{} set to {ty}", field.what), b, field.what.contains("tokenizer."));
        }
    }
}

#[test]
fn seeded_random_mutations() {
    let w = valid_file();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut parsed = 0;
    for case in 0..2000 {
        let mut b = w.bytes.clone();
        let n = 1 + rng.below(8);
        let mut what = Vec::new();
        for _ in 0..n {
            // Mostly in the header, metadata and tensor infos, where the structure is.
            let at = if rng.below(4) == 0 { rng.below(b.len()) } else { rng.below(w.data_start) };
            match rng.below(3) {
                0 => b[at] = rng.next() as u8,
                1 => b[at] ^= 1 << rng.below(8),
                _ => b[at] = [0x00, 0xFF, 0x7F, 0x80][rng.below(4)],
            }
            what.push(format!("{at}={:#04x}", b[at]));
        }
        if rng.below(10) == 0 {
            let cut = rng.below(b.len());
            b.truncate(cut);
            what.push(format!("cut {cut}"));
        }
        if check(&format!("random case {case}: {}", what.join(" ")), b) {
            parsed += 1;
        }
    }
    // Mutations that miss the structure (string contents, data) still parse.
    assert!(parsed > 100 && parsed < 2000, "{parsed}");
}

#[test]
fn other_versions_and_hostile_headers() {
    let w = valid_file();
    for (version, what) in
        [(1u32, "version 1"), (2, ""), (3u32.swap_bytes(), "big-endian"), (4, "unknown"), (u32::MAX, "unknown")]
    {
        let mut b = w.bytes.clone();
        b[4..8].copy_from_slice(&version.to_le_bytes());
        match GgufFile::from_bytes("v.gguf", b) {
            Ok(f) => assert!(what.is_empty() && f.version() == 2, "version {version} parsed"),
            Err(e) => assert!(!what.is_empty() && e.to_string().contains(what), "version {version}: {e}"),
        }
    }
    // Counts far past what the file holds are refused before anything is allocated.
    for (t, k) in [(u64::MAX, u64::MAX), (1 << 40, 0), (0, 1 << 40), (u64::MAX / 2, 1)] {
        let mut b = w.bytes.clone();
        b[8..16].copy_from_slice(&t.to_le_bytes());
        b[16..24].copy_from_slice(&k.to_le_bytes());
        let e = GgufFile::from_bytes("counts.gguf", b).unwrap_err().to_string();
        assert!(e.contains("counts.gguf") && e.contains("cannot fit"), "{t} {k}: {e}");
    }
    // A tensor whose data lies past the end, and an unknown type id, name the tensor.
    let find = |what: &str| w.fields.iter().find(|f| f.what == what).unwrap().at;
    let mut b = w.bytes.clone();
    let at = find("tensor q4_k offset");
    b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let e = GgufFile::from_bytes("o.gguf", b).unwrap_err().to_string();
    assert!(e.contains("`q4_k`") && e.contains("past the end"), "{e}");
    let mut b = w.bytes.clone();
    let at = find("tensor q8_0 type");
    b[at..at + 4].copy_from_slice(&33u32.to_le_bytes());
    let e = GgufFile::from_bytes("t.gguf", b).unwrap_err().to_string();
    assert!(e.contains("`q8_0`") && e.contains("unknown ggml type id 33"), "{e}");
    let mut b = w.bytes.clone();
    let at = find("tensor f32 n_dims");
    b[at..at + 4].copy_from_slice(&5u32.to_le_bytes());
    let e = GgufFile::from_bytes("d.gguf", b).unwrap_err().to_string();
    assert!(e.contains("`f32`") && e.contains("5 dimensions"), "{e}");
    let mut b = w.bytes.clone();
    let at = find("tokenizer.ggml.tokens array length");
    b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let e = GgufFile::from_bytes("a.gguf", b).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.tokens") && e.contains("cannot fit"), "{e}");
}
