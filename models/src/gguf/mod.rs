//! GGUF files (llama.cpp's checkpoint format), versions 2 and 3, little-endian: metadata, tensor
//! infos, and the tensors dequantized to f32 ([`quant`]), plus the mapping of their names, layout
//! and hyperparameters to HF's ([`gguf_tensor_name`], [`unpermute_qk`], [`GgufFile::decoder_fields`])
//! and the tokenizer stored in the metadata ([`GgufFile::tokenizer`]).
//!
//! Layout: `"GGUF"`, `version: u32`, `n_tensors: u64`, `n_kv: u64`, then `n_kv` of
//! `(key: string, type: u32, value)`, then `n_tensors` of `(name: string, n_dims: u32,
//! dims: [u64; n_dims], type: u32, offset: u64)`, then padding to `general.alignment` (default 32),
//! then the data section, each tensor at `offset` from its start. Strings are `(len: u64, bytes)`.
//! Dims are ggml's `ne`: `dims[0]` is the innermost (contiguous) axis, so an HF `[out, in]` weight
//! has GGUF dims `[in, out]` with the same bytes.
//!
//! The parser trusts nothing in the file: every count, length and offset is checked against the
//! bytes that remain before anything is allocated or read, with checked arithmetic, so a
//! truncated or hostile file gives an `Err` naming the file (and key or tensor), never a panic or
//! an allocation larger than the file could justify.

pub mod quant;
mod vocab;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

pub use self::quant::{GgmlType, QK_K, dequantize};
pub use self::vocab::{LLAMA3_PATTERN, QWEN2_PATTERN};
use crate::error::{LoadError, Result};

/// `general.alignment` when the file does not set it.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// How deep arrays of arrays may nest (a bound on the parser's recursion).
const MAX_ARRAY_DEPTH: u32 = 8;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: its elements are all of one type.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    /// The GGUF type's name, for messages (`"u32"`, `"array of string"`).
    pub fn type_name(&self) -> String {
        match self {
            Value::U8(_) => "u8".into(),
            Value::I8(_) => "i8".into(),
            Value::U16(_) => "u16".into(),
            Value::I16(_) => "i16".into(),
            Value::U32(_) => "u32".into(),
            Value::I32(_) => "i32".into(),
            Value::F32(_) => "f32".into(),
            Value::Bool(_) => "bool".into(),
            Value::String(_) => "string".into(),
            Value::Array(a) => format!("array of {}", a.element_type_name()),
            Value::U64(_) => "u64".into(),
            Value::I64(_) => "i64".into(),
            Value::F64(_) => "f64".into(),
        }
    }

    /// An integer value of any width, if it is one and is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A float value, or an integer one converted.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v as f64),
            Value::I16(v) => Some(v as f64),
            Value::I32(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
}

impl Array {
    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn element_type_name(&self) -> &'static str {
        match self {
            Array::U8(_) => "u8",
            Array::I8(_) => "i8",
            Array::U16(_) => "u16",
            Array::I16(_) => "i16",
            Array::U32(_) => "u32",
            Array::I32(_) => "i32",
            Array::F32(_) => "f32",
            Array::Bool(_) => "bool",
            Array::String(_) => "string",
            Array::Array(_) => "array",
            Array::U64(_) => "u64",
            Array::I64(_) => "i64",
            Array::F64(_) => "f64",
        }
    }

    /// The elements as non-negative integers, if they are integers that fit.
    pub fn to_u64_vec(&self) -> Option<Vec<u64>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<u64>) -> Option<Vec<u64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            Array::U8(v) => conv(v, |x| Some(x as u64)),
            Array::U16(v) => conv(v, |x| Some(x as u64)),
            Array::U32(v) => conv(v, |x| Some(x as u64)),
            Array::U64(v) => conv(v, Some),
            Array::I8(v) => conv(v, |x| u64::try_from(x).ok()),
            Array::I16(v) => conv(v, |x| u64::try_from(x).ok()),
            Array::I32(v) => conv(v, |x| u64::try_from(x).ok()),
            Array::I64(v) => conv(v, |x| u64::try_from(x).ok()),
            _ => None,
        }
    }
}

/// A tensor's entry in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml's `ne`, innermost first: an HF `[out, in]` weight is `[in, out]` here.
    pub dims: Vec<usize>,
    pub ggml_type: GgmlType,
    /// From the start of the data section.
    pub offset: u64,
    /// The number of values (the product of `dims`; 1 for zero dims).
    pub n_elements: usize,
    /// The bytes it takes in the file.
    pub n_bytes: usize,
    /// Where its bytes start in the file.
    start: usize,
}

impl TensorInfo {
    /// The shape in HF/row-major order (`dims` reversed): `[out, in]` for a weight.
    pub fn shape_row_major(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file; its bytes stay mapped (or owned) and tensors are read on demand.
pub struct GgufFile {
    path: PathBuf,
    storage: Storage,
    version: u32,
    alignment: u64,
    data_start: usize,
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// A cursor over the file's bytes; its errors are messages the caller puts in context.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

type Msg<T> = std::result::Result<T, String>;

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &str) -> Msg<&'a [u8]> {
        match usize::try_from(n) {
            Ok(n) if n <= self.remaining() => {
                let out = &self.bytes[self.pos..self.pos + n];
                self.pos += n;
                Ok(out)
            }
            _ => Err(format!(
                "truncated: {what} needs {n} bytes at offset {} but only {} remain",
                self.pos,
                self.remaining()
            )),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Msg<[u8; N]> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Msg<u32> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Msg<u64> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Msg<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not valid UTF-8"))
    }

    /// Reads `n` fixed-size elements after checking that they fit.
    fn elements<T, const N: usize>(&mut self, n: u64, f: impl Fn([u8; N]) -> T) -> Msg<Vec<T>> {
        let total = n.checked_mul(N as u64).ok_or_else(|| format!("array of {n} elements overflows"))?;
        let bytes = self.take(total, "array")?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect())
    }

    fn value(&mut self, ty: u32, depth: u32) -> Msg<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>("u8")?[0]),
            1 => Value::I8(self.array::<1>("i8")?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array("u16")?)),
            3 => Value::I16(i16::from_le_bytes(self.array("i16")?)),
            4 => Value::U32(u32::from_le_bytes(self.array("u32")?)),
            5 => Value::I32(i32::from_le_bytes(self.array("i32")?)),
            6 => Value::F32(f32::from_le_bytes(self.array("f32")?)),
            7 => Value::Bool(bool_byte(self.array::<1>("bool")?[0])?),
            8 => Value::String(self.string("string value")?),
            9 => Value::Array(self.array_value(depth)?),
            10 => Value::U64(u64::from_le_bytes(self.array("u64")?)),
            11 => Value::I64(i64::from_le_bytes(self.array("i64")?)),
            12 => Value::F64(f64::from_le_bytes(self.array("f64")?)),
            _ => return Err(format!("unknown value type {ty}")),
        })
    }

    fn array_value(&mut self, depth: u32) -> Msg<Array> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"));
        }
        let ty = self.u32("array element type")?;
        let n = self.u64("array length")?;
        let min = min_value_size(ty).ok_or_else(|| format!("unknown array element type {ty}"))?;
        // No allocation before the elements are known to fit in what is left of the file.
        if n > (self.remaining() / min) as u64 {
            return Err(format!(
                "array of {n} elements of type {ty} cannot fit in the {} bytes left",
                self.remaining()
            ));
        }
        Ok(match ty {
            0 => Array::U8(self.elements(n, |[b]: [u8; 1]| b)?),
            1 => Array::I8(self.elements(n, |[b]: [u8; 1]| b as i8)?),
            2 => Array::U16(self.elements(n, u16::from_le_bytes)?),
            3 => Array::I16(self.elements(n, i16::from_le_bytes)?),
            4 => Array::U32(self.elements(n, u32::from_le_bytes)?),
            5 => Array::I32(self.elements(n, i32::from_le_bytes)?),
            6 => Array::F32(self.elements(n, f32::from_le_bytes)?),
            7 => Array::Bool(self.elements(n, |[b]: [u8; 1]| b)?.into_iter().map(bool_byte).collect::<Msg<_>>()?),
            8 => {
                let mut v = Vec::with_capacity(n as usize);
                for i in 0..n {
                    v.push(self.string(&format!("string element {i}"))?);
                }
                Array::String(v)
            }
            9 => {
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.array_value(depth + 1)?);
                }
                Array::Array(v)
            }
            10 => Array::U64(self.elements(n, u64::from_le_bytes)?),
            11 => Array::I64(self.elements(n, i64::from_le_bytes)?),
            12 => Array::F64(self.elements(n, f64::from_le_bytes)?),
            _ => unreachable!("min_value_size knows only types 0..=12"),
        })
    }
}

fn bool_byte(b: u8) -> Msg<bool> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(format!("bool byte {b} is neither 0 nor 1")),
    }
}

/// The fewest bytes a value of GGUF type `ty` takes (an empty string: its length; an empty
/// array: its element type and length).
fn min_value_size(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// Smallest metadata entry: an empty key (8), the type (4) and a 1-byte value.
const MIN_KV_SIZE: usize = 8 + 4 + 1;
/// Smallest tensor info: an empty name (8), n_dims (4), type (4), offset (8).
const MIN_TENSOR_INFO_SIZE: usize = 8 + 4 + 4 + 8;

impl GgufFile {
    /// Memory-maps and parses `path`.
    ///
    /// The mapping assumes that the file is not modified while it is open (as any mmap-based
    /// loader does); the parse itself trusts nothing in the file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| LoadError::io(path, e))?;
        let len = file.metadata().map_err(|e| LoadError::io(path, e))?.len();
        let storage = if len == 0 {
            // Mapping an empty file fails on some platforms; it is malformed anyway.
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: read-only mapping; like every mmap-based checkpoint loader, this relies on
            // the file not being truncated or rewritten while it is open.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
            Storage::Mapped(map)
        };
        Self::parse(path.to_path_buf(), storage)
    }

    /// Parses a GGUF file held in memory; `name` stands for its path in errors.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(PathBuf::from(name), Storage::Owned(bytes))
    }

    fn parse(path: PathBuf, storage: Storage) -> Result<Self> {
        let bytes = storage.bytes();
        let p = path.as_path();
        let mut r = Reader { bytes, pos: 0 };
        let malformed = |m: String| LoadError::malformed(p, m);

        let magic = r.array::<4>("magic").map_err(malformed)?;
        if &magic != b"GGUF" {
            return Err(malformed(format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")")));
        }
        let version = r.u32("version").map_err(malformed)?;
        match version {
            2 | 3 => {}
            1 => return Err(malformed("GGUF version 1 is not supported (only versions 2 and 3)".into())),
            v if matches!(v.swap_bytes(), 1..=3) => {
                return Err(malformed(format!(
                    "big-endian GGUF (version {} byte-swapped) is not supported",
                    v.swap_bytes()
                )));
            }
            v => return Err(malformed(format!("unknown GGUF version {v} (supported: 2, 3)"))),
        }
        let n_tensors = r.u64("tensor count").map_err(malformed)?;
        let n_kv = r.u64("metadata count").map_err(malformed)?;
        let min_bytes = n_tensors
            .checked_mul(MIN_TENSOR_INFO_SIZE as u64)
            .and_then(|t| n_kv.checked_mul(MIN_KV_SIZE as u64).and_then(|k| k.checked_add(t)));
        if min_bytes.is_none_or(|m| m > r.remaining() as u64) {
            return Err(malformed(format!(
                "{n_tensors} tensors and {n_kv} metadata entries cannot fit in the {} bytes left",
                r.remaining()
            )));
        }

        // Metadata.
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut keys = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = r.string("metadata key").map_err(|m| malformed(format!("metadata entry {i}: {m}")))?;
            let field = |m: String| LoadError::field(p, key.as_str(), m);
            let ty = r.u32("value type").map_err(field)?;
            let value = r.value(ty, 0).map_err(field)?;
            if keys.insert(key.clone(), metadata.len()).is_some() {
                return Err(field("duplicate key".into()));
            }
            metadata.push((key, value));
        }
        let alignment = match keys.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(LoadError::field(p, "general.alignment", format!("{v:?} is not a power of two")));
                }
            },
        };

        // Tensor infos.
        if n_tensors > (r.remaining() / MIN_TENSOR_INFO_SIZE) as u64 {
            return Err(malformed(format!("{n_tensors} tensor infos cannot fit in the {} bytes left", r.remaining())));
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string("tensor name").map_err(|m| malformed(format!("tensor info {i}: {m}")))?;
            let bad = |m: String| LoadError::tensor(p, name.as_str(), m);
            let n_dims = r.u32("n_dims").map_err(bad)?;
            if n_dims as usize > MAX_DIMS {
                return Err(bad(format!("{n_dims} dimensions (at most {MAX_DIMS})")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            let mut n_elements: usize = 1;
            for d in 0..n_dims {
                let dim = r.u64("dimension").map_err(bad)?;
                let dim = usize::try_from(dim)
                    .ok()
                    .filter(|&d| d as u64 <= i64::MAX as u64)
                    .ok_or_else(|| bad(format!("dimension {d} = {dim} is too large")))?;
                n_elements =
                    n_elements.checked_mul(dim).ok_or_else(|| bad(format!("dims {dims:?} × {dim} overflow")))?;
                dims.push(dim);
            }
            let type_id = r.u32("type").map_err(bad)?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| bad(format!("unknown ggml type id {type_id}")))?;
            let offset = r.u64("offset").map_err(bad)?;
            let row = dims.first().copied().unwrap_or(1);
            if !row.is_multiple_of(ggml_type.block_size()) {
                return Err(bad(format!(
                    "row length {row} is not a multiple of the {ggml_type} block size {}",
                    ggml_type.block_size()
                )));
            }
            let n_bytes = (n_elements / ggml_type.block_size())
                .checked_mul(ggml_type.type_size())
                .ok_or_else(|| bad(format!("size of {n_elements} {ggml_type} values overflows")))?;
            if !offset.is_multiple_of(alignment) {
                return Err(bad(format!("offset {offset} is not a multiple of the alignment {alignment}")));
            }
            if tensor_index.insert(name.clone(), infos.len()).is_some() {
                return Err(bad("duplicate tensor name".into()));
            }
            infos.push(TensorInfo { name, dims, ggml_type, offset, n_elements, n_bytes, start: 0 });
        }

        // The data section, and each tensor's range in it.
        let data_start = (r.pos as u64)
            .checked_next_multiple_of(alignment)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(|| malformed("data section start overflows".into()))?;
        for info in &mut infos {
            let range = usize::try_from(info.offset)
                .ok()
                .and_then(|o| data_start.checked_add(o))
                .and_then(|s| Some((s, s.checked_add(info.n_bytes)?)));
            match range {
                Some((start, end)) if end <= bytes.len() => info.start = start,
                _ => {
                    return Err(LoadError::tensor(
                        p,
                        info.name.as_str(),
                        format!(
                            "data ({} bytes at offset {} from the data section at {data_start}) extends past the end of the file ({} bytes)",
                            info.n_bytes,
                            info.offset,
                            bytes.len()
                        ),
                    ));
                }
            }
        }
        // No two tensors share bytes (ggml's writers lay them out one after another), so reading
        // every tensor reads each byte of the file at most once.
        let mut by_start: Vec<&TensorInfo> = infos.iter().filter(|t| t.n_bytes > 0).collect();
        by_start.sort_by_key(|t| t.start);
        for pair in by_start.windows(2) {
            if pair[1].start < pair[0].start + pair[0].n_bytes {
                return Err(LoadError::tensor(
                    p,
                    pair[1].name.as_str(),
                    format!("data overlaps that of tensor `{}`", pair[0].name),
                ));
            }
        }

        Ok(Self { path, storage, version, alignment, data_start, metadata, keys, tensors: infos, tensor_index })
    }

    /// The path it was opened from (or the name given to [`GgufFile::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Where the data section starts in the file.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// The metadata entries, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    fn required(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| LoadError::field(&self.path, key, "missing"))
    }

    fn wrong_type(&self, key: &str, expected: &str, found: &Value) -> LoadError {
        LoadError::field(&self.path, key, format!("expected {expected}, found {}", found.type_name()))
    }

    /// An integer of any width that is not negative.
    pub fn u64(&self, key: &str) -> Result<u64> {
        let v = self.required(key)?;
        v.as_u64().ok_or_else(|| self.wrong_type(key, "a non-negative integer", v))
    }

    /// Like [`GgufFile::u64`], `None` when missing.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key).map(|_| self.u64(key)).transpose()
    }

    /// A float (f32 widened) or an integer.
    pub fn f64(&self, key: &str) -> Result<f64> {
        let v = self.required(key)?;
        v.as_f64().ok_or_else(|| self.wrong_type(key, "a number", v))
    }

    /// Like [`GgufFile::f64`], `None` when missing.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|_| self.f64(key)).transpose()
    }

    pub fn bool(&self, key: &str) -> Result<bool> {
        match self.required(key)? {
            Value::Bool(b) => Ok(*b),
            v => Err(self.wrong_type(key, "bool", v)),
        }
    }

    /// Like [`GgufFile::bool`], `None` when missing.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|_| self.bool(key)).transpose()
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        match self.required(key)? {
            Value::String(s) => Ok(s),
            v => Err(self.wrong_type(key, "string", v)),
        }
    }

    /// Like [`GgufFile::str`], `None` when missing.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key).map(|_| self.str(key)).transpose()
    }

    pub fn array(&self, key: &str) -> Result<&Array> {
        match self.required(key)? {
            Value::Array(a) => Ok(a),
            v => Err(self.wrong_type(key, "array", v)),
        }
    }

    pub fn str_array(&self, key: &str) -> Result<&[String]> {
        match self.array(key)? {
            Array::String(v) => Ok(v),
            a => Err(self.wrong_type(key, "array of string", &Value::Array(a.clone()))),
        }
    }

    pub fn f32_array(&self, key: &str) -> Result<&[f32]> {
        match self.array(key)? {
            Array::F32(v) => Ok(v),
            a => Err(self.wrong_type(key, "array of f32", &Value::Array(a.clone()))),
        }
    }

    pub fn i32_array(&self, key: &str) -> Result<&[i32]> {
        match self.array(key)? {
            Array::I32(v) => Ok(v),
            a => Err(self.wrong_type(key, "array of i32", &Value::Array(a.clone()))),
        }
    }

    /// The tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of tensor `name`, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Whether the file holds tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_info(name).ok_or_else(|| LoadError::tensor(&self.path, name, "not in the file"))
    }

    /// Tensor `name` as stored: its type, dims (innermost first) and bytes.
    pub fn tensor_raw(&self, name: &str) -> Result<(GgmlType, &[usize], &[u8])> {
        let info = self.info(name)?;
        // The range was checked against the file's length when it was parsed.
        let bytes = &self.storage.bytes()[info.start..info.start + info.n_bytes];
        Ok((info.ggml_type, &info.dims, bytes))
    }

    /// Tensor `name` dequantized to f32: its dims (GGUF order, innermost first) and values in
    /// storage order (row-major for the reversed dims, i.e. HF's layout).
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (ty, dims, bytes) = self.tensor_raw(name)?;
        let values = quant::dequantize(ty, bytes).map_err(|m| LoadError::tensor(&self.path, name, m))?;
        Ok((dims.to_vec(), values))
    }

    /// The decoder hyperparameters under `{general.architecture}.*`, and the vocabulary size.
    pub fn decoder_fields(&self) -> Result<GgufModelInfo> {
        let arch = self.str("general.architecture")?.to_string();
        let k = |s: &str| format!("{arch}.{s}");
        let head_count = self.per_layer_uniform(&k("attention.head_count"))?;
        let head_count_kv = match self.get(&k("attention.head_count_kv")) {
            Some(_) => self.per_layer_uniform(&k("attention.head_count_kv"))?,
            None => head_count,
        };
        let embedding_length = self.u64(&k("embedding_length"))?;
        let key_length = self.opt_u64(&k("attention.key_length"))?;
        let head_dim = match key_length {
            Some(d) => d,
            None if head_count > 0 => embedding_length / head_count,
            None => {
                return Err(LoadError::field(&self.path, k("attention.head_count"), "is 0"));
            }
        };
        let rope_scaling = match self.opt_str(&k("rope.scaling.type"))? {
            None | Some("none") => None,
            Some(kind) => Some(RopeScaling {
                kind: kind.to_string(),
                factor: self.opt_f64(&k("rope.scaling.factor"))?,
                original_context_length: self.opt_u64(&k("rope.scaling.original_context_length"))?,
            }),
        };
        let vocab_size = match self.get("tokenizer.ggml.tokens") {
            Some(_) => self.array("tokenizer.ggml.tokens")?.len(),
            None => match self.opt_u64(&k("vocab_size"))? {
                Some(v) => {
                    usize::try_from(v).map_err(|_| LoadError::field(&self.path, k("vocab_size"), "too large"))?
                }
                None => {
                    return Err(LoadError::field(&self.path, "tokenizer.ggml.tokens", "missing (and no vocab_size)"));
                }
            },
        };
        let ffn = self.per_layer_uniform(&k("feed_forward_length"))?;
        Ok(GgufModelInfo {
            context_length: self.u64(&k("context_length"))?,
            embedding_length,
            block_count: self.u64(&k("block_count"))?,
            feed_forward_length: ffn,
            head_count,
            head_count_kv,
            rms_norm_eps: self.f64(&k("attention.layer_norm_rms_epsilon"))?,
            rope_freq_base: self.opt_f64(&k("rope.freq_base"))?.unwrap_or(10000.0),
            key_length,
            value_length: self.opt_u64(&k("attention.value_length"))?,
            head_dim,
            rope_dimension_count: self.opt_u64(&k("rope.dimension_count"))?,
            rope_scaling,
            sliding_window: self.opt_u64(&k("attention.sliding_window"))?,
            vocab_size,
            bos_token_id: self.opt_u64("tokenizer.ggml.bos_token_id")?,
            eos_token_id: self.opt_u64("tokenizer.ggml.eos_token_id")?,
            tied_embeddings: !self.contains("output.weight"),
            has_rope_freqs: self.contains("rope_freqs.weight"),
            architecture: arch,
        })
    }

    /// An integer, or an array of per-layer integers that are all equal.
    fn per_layer_uniform(&self, key: &str) -> Result<u64> {
        match self.required(key)? {
            Value::Array(a) => {
                let v = a.to_u64_vec().ok_or_else(|| self.wrong_type(key, "integers", &Value::Array(a.clone())))?;
                match v.first() {
                    Some(&x) if v.iter().all(|&y| y == x) => Ok(x),
                    Some(_) => Err(LoadError::field(&self.path, key, format!("differs between layers: {v:?}"))),
                    None => Err(LoadError::field(&self.path, key, "empty array")),
                }
            }
            _ => self.u64(key),
        }
    }
}

/// How RoPE is scaled (`{arch}.rope.scaling.*`). Llama 3's scaling is not here: llama.cpp stores
/// it as the tensor `rope_freqs.weight` (per-frequency divisors), see [`GgufModelInfo::has_rope_freqs`].
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    /// `"linear"`, `"yarn"`, `"longrope"`, ...
    pub kind: String,
    pub factor: Option<f64>,
    pub original_context_length: Option<u64>,
}

/// A decoder's hyperparameters as a GGUF file states them.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufModelInfo {
    /// `general.architecture`: `"llama"` (also Mistral), `"qwen2"`, `"qwen3"`, ...
    pub architecture: String,
    pub context_length: u64,
    /// Hidden size.
    pub embedding_length: u64,
    /// Layers.
    pub block_count: u64,
    /// Intermediate size.
    pub feed_forward_length: u64,
    pub head_count: u64,
    /// `head_count` when the file does not say.
    pub head_count_kv: u64,
    pub rms_norm_eps: f64,
    /// RoPE theta (10000 when the file does not say).
    pub rope_freq_base: f64,
    /// `attention.key_length` as stored.
    pub key_length: Option<u64>,
    pub value_length: Option<u64>,
    /// `key_length`, else `embedding_length / head_count`.
    pub head_dim: u64,
    pub rope_dimension_count: Option<u64>,
    pub rope_scaling: Option<RopeScaling>,
    /// `attention.sliding_window` (llama.cpp's converter does not write it for Mistral).
    pub sliding_window: Option<u64>,
    /// The length of `tokenizer.ggml.tokens` (else `{arch}.vocab_size`).
    pub vocab_size: usize,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    /// No `output.weight`: the head is the token embedding.
    pub tied_embeddings: bool,
    /// The file holds `rope_freqs.weight` (Llama 3.1 RoPE scaling, as frequency divisors).
    pub has_rope_freqs: bool,
}

/// The GGUF (llama.cpp) name of the HF tensor `hf_name`, for Llama/Mistral/Qwen2/Qwen3 decoders.
pub fn gguf_tensor_name(hf_name: &str) -> Option<String> {
    match hf_name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) || (layer.len() > 1 && layer.starts_with('0')) {
        return None;
    }
    let (module, suffix) = rest.rsplit_once('.')?;
    let name = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    let suffix_ok = match suffix {
        "weight" => true,
        "bias" => {
            name.starts_with("attn_") && !name.ends_with("_norm") || name.starts_with("ffn_") && name != "ffn_norm"
        }
        _ => false,
    };
    suffix_ok.then(|| format!("blk.{layer}.{name}.{suffix}"))
}

/// Undoes llama.cpp's `LlamaModel.permute` of a Q or K projection (`llama` architecture only; not
/// Qwen2/Qwen3, which store HF's layout).
///
/// `data` is `rows × cols` row-major (HF `[out, in]`; for a bias `cols = 1`); `n_head` is the
/// attention head count for Q and the KV head count for K. The converter reshapes the rows to
/// `[n_head, 2, head_dim / 2]` and swaps the last two axes, so stored row `h·hd + 2i + j` is HF
/// row `h·hd + j·hd/2 + i`. Whole rows move, so `T` may also be raw bytes of quantized rows
/// (`cols` = bytes per row). `None` if the sizes do not fit (`rows` not a multiple of
/// `2 · n_head`, or `data.len() != rows · cols`).
pub fn unpermute_qk<T: Copy>(data: &[T], rows: usize, cols: usize, n_head: usize) -> Option<Vec<T>> {
    if n_head == 0 || !rows.is_multiple_of(n_head.checked_mul(2)?) || data.len() != rows.checked_mul(cols)? {
        return None;
    }
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = Vec::with_capacity(data.len());
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let stored = h * head_dim + 2 * i + j;
                out.extend_from_slice(&data[stored * cols..(stored + 1) * cols]);
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests;
