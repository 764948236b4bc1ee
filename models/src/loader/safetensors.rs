//! HF safetensors checkpoints, one file or sharded (`model.safetensors.index.json`), memory-mapped:
//! each tensor is read from the mapping when the model asks for it, converted and uploaded, so the
//! host never holds more than one tensor's copy.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, FloatDType, Tensor, TensorData, backend::Backend};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, tensor::Metadata};

use super::{ParamKind, ParamSource, Stored, StoredDtype, transpose_bytes, upload};
use crate::error::{LoadError, Result};

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Where the data section starts (after the 8-byte length and the JSON header).
    data_start: usize,
    metadata: Metadata,
}

/// The tensors of a safetensors checkpoint, read on demand into a chosen float dtype.
pub struct SafetensorsSource {
    shards: Vec<Shard>,
    /// Tensor name → shard index.
    names: HashMap<String, usize>,
    dtype: FloatDType,
    /// Called with each tensor's byte count as it is loaded (a progress bar).
    progress: Option<Box<dyn FnMut(u64)>>,
}

impl SafetensorsSource {
    /// Opens `dir/model.safetensors`, or the shards `dir/model.safetensors.index.json` lists, or a
    /// single `.safetensors` file given directly. Parameters are loaded as `dtype`.
    pub fn open(path: &Path, dtype: FloatDType) -> Result<Self> {
        let files = if path.is_file() {
            vec![path.to_path_buf()]
        } else if path.join("model.safetensors.index.json").is_file() {
            shard_files(&path.join("model.safetensors.index.json"))?
        } else {
            vec![path.join("model.safetensors")]
        };
        let shards = files.iter().map(|f| open_shard(f)).collect::<Result<Vec<_>>>()?;
        let mut names = HashMap::new();
        for (i, shard) in shards.iter().enumerate() {
            for name in shard.metadata.tensors().into_keys() {
                if let Some(j) = names.insert(name.clone(), i) {
                    return Err(LoadError::tensor(&shard.path, name, format!("also stored in {}", shards[j].path.display())));
                }
            }
        }
        Ok(Self { shards, names, dtype, progress: None })
    }

    /// Reports each loaded tensor's size in bytes to `f`.
    pub fn with_progress(mut self, f: impl FnMut(u64) + 'static) -> Self {
        self.progress = Some(Box::new(f));
        self
    }

    /// Bytes of all tensors in the checkpoint.
    pub fn total_bytes(&self) -> u64 {
        let shard_bytes = |s: &Shard| s.metadata.tensors().values().map(|t| (t.data_offsets.1 - t.data_offsets.0) as u64).sum::<u64>();
        self.shards.iter().map(shard_bytes).sum()
    }

    /// Tensor names in the checkpoint.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// The stored shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.raw(name).map(|(_, shape, _, _)| shape.to_vec())
    }

    /// The raw stored tensor: its shape, dtype and bytes (borrowed from the mapping).
    fn raw(&self, name: &str) -> Option<(&Path, &[usize], Dtype, &[u8])> {
        let shard = &self.shards[*self.names.get(name)?];
        let info = shard.metadata.info(name)?;
        let (start, end) = info.data_offsets;
        // read_metadata validated every offset against the file's length.
        let bytes = &shard.map[shard.data_start + start..shard.data_start + end];
        Some((&shard.path, &info.shape, info.dtype, bytes))
    }
}

impl ParamSource for SafetensorsSource {
    fn param<B: Backend, const D: usize>(&mut self, name: &str, shape: [usize; D], kind: ParamKind, device: &B::Device) -> Result<Tensor<B, D>> {
        let first = &self.shards[0].path;
        let (path, stored, dtype, bytes) = self.raw(name).ok_or_else(|| LoadError::tensor(first, name, "missing from the checkpoint"))?;
        let dtype = match dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => return Err(LoadError::tensor(path, name, format!("stored as {other:?}; expected F32, F16 or BF16"))),
        };
        // Linear weights are stored [out, in] and kept [in, out].
        let file_shape: Vec<usize> = if kind == ParamKind::Linear { shape.iter().rev().copied().collect() } else { shape.to_vec() };
        if stored != file_shape {
            return Err(LoadError::tensor(path, name, format!("shape {stored:?}; the config needs {file_shape:?}")));
        }
        let data = if kind == ParamKind::Linear {
            transpose_bytes(bytes, file_shape[0], file_shape[1], dtype.size())
        } else {
            bytes.to_vec()
        };
        let loaded = bytes.len() as u64;
        let tensor = upload(TensorData::from_bytes_vec(data, shape, dtype), self.dtype, device);
        if let Some(progress) = self.progress.as_mut() {
            progress(loaded);
        }
        Ok(tensor)
    }

    fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    fn stored(&self, name: &str) -> Option<Stored<'_>> {
        let (_, shape, dtype, bytes) = self.raw(name)?;
        let dtype = match dtype {
            Dtype::U8 => StoredDtype::U8,
            Dtype::F32 => StoredDtype::F32,
            Dtype::F16 => StoredDtype::F16,
            Dtype::BF16 => StoredDtype::BF16,
            _ => StoredDtype::Other("another dtype"),
        };
        Some(Stored { dtype, shape, bytes })
    }

    fn origin(&self) -> &Path {
        &self.shards[0].path
    }
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = File::open(path).map_err(|e| LoadError::io(path, e))?;
    // SAFETY: the mapping is read-only and the checkpoint is not expected to change while loading;
    // a file truncated meanwhile would fault, as with any memory-mapped reader.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
    let (header, metadata) = SafeTensors::read_metadata(&map).map_err(|e| LoadError::malformed(path, e.to_string()))?;
    Ok(Shard { path: path.to_path_buf(), map, data_start: 8 + header, metadata })
}

/// The shard files an index names, each a plain file name in the index's directory.
fn shard_files(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|e| LoadError::io(index, e))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| LoadError::malformed(index, format!("not JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| LoadError::field(index, "weight_map", "missing or not an object"))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| LoadError::field(index, format!("weight_map.{tensor}"), "not a file name"))?;
        let plain = Path::new(file).file_name().is_some_and(|f| f == file);
        if !plain {
            return Err(LoadError::field(index, format!("weight_map.{tensor}"), format!("`{file}` is not a file name in the index's folder")));
        }
        let path = dir.join(file);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}
