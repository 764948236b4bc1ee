//! A 4-bit weight as bitsandbytes saves it (transformers' `save_pretrained` of a
//! `BitsAndBytesConfig(load_in_4bit=True)` model): for a weight `<w>` the tensors `<w>` (uint8
//! `[n·k/2, 1]`), `<w>.absmax` (f32, or uint8 codes with double quantization), `<w>.quant_map`,
//! `<w>.nested_absmax`, `<w>.nested_quant_map` and `<w>.quant_state.bitsandbytes__<type>` (the
//! JSON state as uint8 bytes). Every length is checked against the state before anything is
//! allocated from it; errors name the tensor and the field.

use serde::Deserialize;

use super::format::{Absmax, DYNAMIC_CODE, FormatError, NESTED_BLOCK, Packed4, QuantType};

/// A stored tensor's element type, as far as quantized checkpoints use them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    U8,
    F32,
    F16,
    BF16,
    /// Anything else (named for the error message).
    Other(&'static str),
}

impl StoredDtype {
    /// Bytes of one element (`Other`: 1, so lengths are only compared for known types).
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::U8 | Self::Other(_) => 1,
        }
    }

    /// The little-endian element at the start of `bytes` as f32, for the float types.
    pub fn read_f32(self, bytes: &[u8]) -> Option<f32> {
        let b = bytes.get(..self.size())?;
        match self {
            Self::F32 => Some(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            Self::F16 => Some(half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
            Self::BF16 => Some(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            Self::U8 | Self::Other(_) => None,
        }
    }
}

/// One stored tensor: its element type, shape and raw little-endian bytes.
#[derive(Debug, Clone, Copy)]
pub struct Stored<'a> {
    pub dtype: StoredDtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

#[derive(Deserialize)]
struct QuantState {
    quant_type: String,
    blocksize: usize,
    shape: Vec<usize>,
    #[serde(default)]
    nested_blocksize: Option<usize>,
    #[serde(default)]
    nested_offset: Option<f64>,
}

/// The quantization types whose state a weight named `name` may carry, by tensor suffix.
pub const STATE_SUFFIXES: [(&str, QuantType); 2] =
    [("quant_state.bitsandbytes__nf4", QuantType::Nf4), ("quant_state.bitsandbytes__fp4", QuantType::Fp4)];

/// The tensors bitsandbytes stores beside a 4-bit weight `<w>`, as suffixes of `<w>` (besides the
/// states of [`STATE_SUFFIXES`]).
const PART_SUFFIXES: [&str; 4] = ["absmax", "quant_map", "nested_absmax", "nested_quant_map"];

/// Whether `name` is a 4-bit weight's stored state (`<w>.quant_state.bitsandbytes__nf4`).
pub fn is_state(name: &str) -> bool {
    STATE_SUFFIXES.iter().any(|(s, _)| name.strip_suffix(s).is_some_and(|w| w.ends_with('.')))
}

/// Whether `name` is one of the tensors bitsandbytes stores beside a 4-bit weight.
pub fn is_stored_part(name: &str) -> bool {
    is_state(name) || PART_SUFFIXES.iter().any(|s| name.strip_suffix(s).is_some_and(|w| w.ends_with('.')))
}

/// Whether the weight `weight` (`<module>.weight`) is stored in 4 bits, by `contains(name)`.
pub fn stored_4bit(weight: &str, contains: impl Fn(&str) -> bool) -> bool {
    STATE_SUFFIXES.iter().any(|(s, _)| contains(&format!("{weight}.{s}")))
}

/// Read the 4-bit weight `name` through `get(full tensor name)`.
pub fn from_bnb<'a>(name: &str, get: impl Fn(&str) -> Option<Stored<'a>>) -> Result<Packed4, FormatError> {
    let get = &get;
    let err = |what: &str, msg: String| FormatError(format!("{name}{what}: {msg}"));
    let (suffix, kind, state) = STATE_SUFFIXES
        .iter()
        .find_map(|&(s, k)| get(&format!("{name}.{s}")).map(|t| (s, k, t)))
        .ok_or_else(|| err("", "no `quant_state.bitsandbytes__nf4` (or `__fp4`) tensor".into()))?;
    let state: QuantState = serde_json::from_slice(state.bytes).map_err(|e| err(&format!(".{suffix}"), format!("not a bitsandbytes state: {e}")))?;
    if QuantType::from_name(&state.quant_type) != Some(kind) {
        return Err(err(&format!(".{suffix}"), format!("quant_type {:?} in a {} state", state.quant_type, kind.name())));
    }
    let n = state.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| err(&format!(".{suffix}"), format!("shape {:?} overflows", state.shape)))?;
    let block = state.blocksize;
    super::format::check_layout(n, &state.shape, block).map_err(|e| err(&format!(".{suffix}"), e.0))?;
    let blocks = n.div_ceil(block);

    let weight = tensor(get, name, "", StoredDtype::U8, n / 2)?;
    let quant_map = floats(tensor(get, name, ".quant_map", StoredDtype::F32, 16)?);
    if quant_map.iter().zip(kind.code()).any(|(a, b)| a != b) {
        return Err(err(".quant_map", format!("{quant_map:?} is not bitsandbytes' {} code book", kind.name())));
    }
    let absmax = match (state.nested_offset, get(&format!("{name}.nested_absmax"))) {
        (Some(offset), Some(_)) => {
            if state.nested_blocksize != Some(NESTED_BLOCK) {
                return Err(err(&format!(".{suffix}"), format!("nested_blocksize {:?}; expected {NESTED_BLOCK}", state.nested_blocksize)));
            }
            let nested_map = floats(tensor(get, name, ".nested_quant_map", StoredDtype::F32, 256)?);
            if nested_map.iter().zip(DYNAMIC_CODE.iter()).any(|(a, b)| a != b) {
                return Err(err(".nested_quant_map", "not bitsandbytes' signed dynamic code".into()));
            }
            Absmax::Nested {
                codes: tensor(get, name, ".absmax", StoredDtype::U8, blocks)?.to_vec(),
                absmax: floats(tensor(get, name, ".nested_absmax", StoredDtype::F32, blocks.div_ceil(NESTED_BLOCK))?),
                offset: offset as f32,
            }
        }
        (None, None) => Absmax::Plain(floats(tensor(get, name, ".absmax", StoredDtype::F32, blocks)?)),
        _ => return Err(err(&format!(".{suffix}"), "nested_offset and the nested_absmax tensor must come together".into())),
    };
    Packed4::from_parts(kind, block, &state.shape, weight.to_vec(), absmax).map_err(|e| err("", e.0))
}

/// The bytes of `<name><suffix>`, checked to hold `len` elements of `dtype`.
fn tensor<'a>(get: &impl Fn(&str) -> Option<Stored<'a>>, name: &str, suffix: &str, dtype: StoredDtype, len: usize) -> Result<&'a [u8], FormatError> {
    let full = format!("{name}{suffix}");
    let t = get(&full).ok_or_else(|| FormatError(format!("{full}: missing")))?;
    let size = dtype.size();
    if t.dtype != dtype {
        return Err(FormatError(format!("{full}: dtype {:?}; expected {dtype:?}", t.dtype)));
    }
    if t.bytes.len() != len * size {
        return Err(FormatError(format!("{full}: {} bytes; expected {len} values of {dtype:?}", t.bytes.len())));
    }
    Ok(t.bytes)
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}
