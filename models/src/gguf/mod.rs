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

mod decoder;
pub mod quant;
pub mod ternary;
mod value;
mod vocab;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

pub use self::decoder::{GgufModelInfo, RopeScaling, gguf_tensor_name, unpermute_qk};
pub use self::quant::{GgmlType, QK_K, dequantize};
pub use self::value::{Array, Value};
pub use self::vocab::{LLAMA3_PATTERN, QWEN2_PATTERN};
use crate::error::{LoadError, Result};

/// `general.alignment` when the file does not set it.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// How deep arrays of arrays may nest (a bound on the parser's recursion).
const MAX_ARRAY_DEPTH: u32 = 8;

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
}

#[cfg(test)]
mod tests;
