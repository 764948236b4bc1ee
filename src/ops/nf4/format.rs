//! The bitsandbytes 4-bit formats on the host: code books, the per-value rounding, blockwise
//! quantization with f32 absmax scales, and double quantization of those scales. This is the
//! bit-level definition that the kernels reproduce exactly and that checkpoints are read with.
//!
//! Layout (bitsandbytes' `quantize_4bit`, read from its `functional.py` and `kernels.cu`): the
//! tensor is flattened row-major and cut into blocks of `block` values; each block stores
//! `absmax = max |x|` in f32 and the 4-bit code of `x · (1 / absmax)`; two codes share a byte, the
//! first element in the high nibble. Double quantization (`compress_statistics`) replaces the
//! absmax vector by `offset = mean(absmax)` and `absmax − offset` quantized to 8 bits with the
//! signed dynamic code in blocks of 256, each with its own f32 absmax.
//!
//! bitsandbytes' CUDA build compiles with `--use_fast_math`: subnormal results flush to zero,
//! which kiln reproduces ([`flush_subnormal`]), and its `1 / absmax` is the hardware's
//! approximate reciprocal (≤ 1 ulp off), which kiln does not: it divides exactly, the same on
//! every backend. Codes can therefore differ only for a
//! scaled value within an ulp or two of a rounding threshold (`tests/nf4.rs` checks that every
//! difference is one of those). Its offset is a CUDA `mean`, whose summation order kiln does not
//! copy: kiln's is the f64 mean rounded to f32.

/// The 4-bit data type of a quantized tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum QuantType {
    /// NormalFloat4 (QLoRA): 16 quantiles of N(0, 1) scaled to [−1, 1], with an exact zero.
    Nf4,
    /// bitsandbytes' FP4: sign + 3-bit e2m1-style magnitude, scaled to [−1, 1].
    Fp4,
}

/// The block sizes bitsandbytes accepts for 4-bit quantization.
pub const BLOCK_SIZES: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/// Block size of the second (8-bit) quantization of the absmax values.
pub const NESTED_BLOCK: usize = 256;

/// NF4 values by code (bitsandbytes' `nf4_dequantization_lut`, its literals as written).
#[allow(clippy::excessive_precision)]
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// NF4 rounding thresholds, ascending: the code of `x` is the number of thresholds below it
/// (bitsandbytes' `dQuantizeNF4` decision tree, whose pivots these are). A NaN (a block of zeros
/// scaled by `1 / 0`) exceeds none and takes code 0, as in bitsandbytes.
#[allow(clippy::excessive_precision)]
const NF4_THRESHOLDS: [f32; 15] = [
    -0.848_096_400_499_343_9,
    -0.610_632_926_225_662_2,
    -0.459_995_269_775_390_6,
    -0.339_679_434_895_515_44,
    -0.234_607_405_960_559_84,
    -0.137_911_733_239_889_14,
    -0.045_525_018_125_772_476,
    0.039_790_149_778_127_67,
    0.120_255_250_483_751_3,
    0.203_521_251_678_466_8,
    0.292_013_771_831_989_3,
    0.389_312_535_524_368_3,
    0.501_663_416_624_069_2,
    0.642_786_920_070_648_2,
    0.861_478_418_111_801_1,
];

/// FP4 magnitudes by the low three bits of the code (bitsandbytes' `fp4_dequantization_lut`);
/// bit 3 is the sign.
#[allow(clippy::excessive_precision)]
const FP4_MAGNITUDE: [f32; 8] = [0.0, 0.005_208_333_333, 0.666_666_67, 1.0, 0.333_333_33, 0.5, 0.166_666_67, 0.25];

/// FP4 magnitude thresholds, ascending, and the 3-bit code of each magnitude interval
/// (bitsandbytes' `dQuantizeFP4` tree).
#[allow(clippy::excessive_precision)]
const FP4_THRESHOLDS: [f32; 7] = [0.002_604_17, 0.085_937_5, 0.208_333_33, 0.291_666_67, 0.416_666_7, 0.583_333, 0.833_333_3];
const FP4_RANK_CODE: [u8; 8] = [0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011];

/// FP4 values by code: the magnitude with the sign of bit 3 (code 8 is −0).
pub const FP4_CODE: [f32; 16] = {
    let mut code = [0f32; 16];
    let mut i = 0;
    while i < 8 {
        code[i] = FP4_MAGNITUDE[i];
        code[i + 8] = -FP4_MAGNITUDE[i];
        i += 1;
    }
    code
};

/// bitsandbytes' signed 8-bit dynamic code (`create_dynamic_map(signed=True)`), sorted: the code
/// of the double-quantized absmax values. Bit patterns as bitsandbytes builds them in f32.
pub static DYNAMIC_CODE: [f32; 256] = {
    const BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
    ];
    let mut code = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        code[i] = f32::from_bits(BITS[i]);
        i += 1;
    }
    code
};

impl QuantType {
    /// Values by code.
    pub fn code(self) -> &'static [f32; 16] {
        match self {
            Self::Nf4 => &NF4_CODE,
            Self::Fp4 => &FP4_CODE,
        }
    }

    /// The 4-bit code of a value already scaled into [−1, 1].
    pub fn quantize(self, x: f32) -> u8 {
        match self {
            Self::Nf4 => NF4_THRESHOLDS.iter().filter(|&&t| x > t).count() as u8,
            Self::Fp4 => {
                let sign = if x < 0.0 { 8 } else { 0 };
                let rank = FP4_THRESHOLDS.iter().filter(|&&t| x.abs() > t).count();
                FP4_RANK_CODE[rank] | sign
            }
        }
    }

    /// The ascending rounding thresholds the kernels compare against: NF4's 15, FP4's 7
    /// magnitudes.
    pub fn thresholds(self) -> &'static [f32] {
        match self {
            Self::Nf4 => &NF4_THRESHOLDS,
            Self::Fp4 => &FP4_THRESHOLDS,
        }
    }

    /// bitsandbytes' name (`quant_type`, and the suffix of `quant_state.bitsandbytes__<name>`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Nf4 => "nf4",
            Self::Fp4 => "fp4",
        }
    }

    /// The type named `name` (`"nf4"`, `"fp4"`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "nf4" => Some(Self::Nf4),
            "fp4" => Some(Self::Fp4),
            _ => None,
        }
    }
}

/// The 8-bit dynamic code of a value scaled into [−1, 1]: bitsandbytes' `dQuantize` (a binary
/// search over the sorted code, then the nearer neighbour by f32 midpoints), step for step so that
/// ties and NaN land where they land there.
pub fn quantize_dynamic(x: f32) -> u8 {
    let code = &DYNAMIC_CODE;
    let (mut pivot, mut upper_pivot, mut lower_pivot) = (127usize, 255usize, 0usize);
    let (mut lower, mut upper) = (-1.0f32, 1.0f32);
    let mut val = code[pivot];
    let mut step = 64;
    while step > 0 {
        if x > val {
            lower_pivot = pivot;
            lower = val;
            pivot += step;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= step;
        }
        val = code[pivot];
        step >>= 1;
    }
    if upper_pivot == 255 {
        upper = code[255];
    }
    if lower_pivot == 0 {
        lower = code[0];
    }
    let chosen = if x > val {
        if x > (upper + val) * 0.5 { upper_pivot } else { pivot }
    } else if x < (lower + val) * 0.5 {
        lower_pivot
    } else {
        pivot
    };
    chosen as u8
}

/// Per-block `max |x|` and the codes of `x · (1 / absmax)` produced by `code_of`, for blocks of
/// `block` values (the last one may be shorter).
fn quantize_blocks(values: &[f32], block: usize, mut code_of: impl FnMut(f32) -> u8, mut emit: impl FnMut(usize, u8)) -> Vec<f32> {
    values
        .chunks(block)
        .enumerate()
        .map(|(b, chunk)| {
            let absmax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let recip = flush_subnormal(1.0 / absmax);
            for (i, &v) in chunk.iter().enumerate() {
                emit(b * block + i, code_of(flush_subnormal(v * recip)));
            }
            absmax
        })
        .collect()
}

/// Zero for a subnormal `x`, as bitsandbytes' CUDA build computes (`--use_fast_math` flushes
/// subnormal results): a block whose absmax exceeds 2¹²⁶ gets a zero reciprocal there, so all of
/// its codes are the code of 0. kiln does the same so that its files agree with bitsandbytes'.
pub fn flush_subnormal(x: f32) -> f32 {
    if x.is_subnormal() { 0.0 } else { x }
}

/// The block scales of a 4-bit tensor: f32 absmax values, or their double-quantized form.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Absmax {
    /// One f32 per block.
    Plain(Vec<f32>),
    /// `DYNAMIC_CODE[codes[b]] · absmax[b / 256] + offset` per block.
    Nested { codes: Vec<u8>, absmax: Vec<f32>, offset: f32 },
}

impl Absmax {
    /// Double-quantize plain absmax values with the offset bitsandbytes would use (the mean).
    pub fn nested(absmax: &[f32]) -> Self {
        let offset = (absmax.iter().map(|&v| v as f64).sum::<f64>() / absmax.len().max(1) as f64) as f32;
        Self::nested_with_offset(absmax, offset)
    }

    /// Double-quantize plain absmax values around a given offset (the tests pass bitsandbytes'
    /// own, whose summation order differs from kiln's).
    pub fn nested_with_offset(absmax: &[f32], offset: f32) -> Self {
        let centred: Vec<f32> = absmax.iter().map(|&v| v - offset).collect();
        let mut codes = vec![0u8; centred.len()];
        let absmax = quantize_blocks(&centred, NESTED_BLOCK, quantize_dynamic, |i, c| codes[i] = c);
        Self::Nested { codes, absmax, offset }
    }

    /// Number of blocks described.
    pub fn blocks(&self) -> usize {
        match self {
            Self::Plain(v) => v.len(),
            Self::Nested { codes, .. } => codes.len(),
        }
    }

    /// The f32 absmax of every block (dequantized when nested, with bitsandbytes' operation order:
    /// code × scale, then + offset, in f32).
    pub fn values(&self) -> Vec<f32> {
        match self {
            Self::Plain(v) => v.clone(),
            Self::Nested { codes, absmax, offset } => codes
                .iter()
                .enumerate()
                .map(|(b, &c)| DYNAMIC_CODE[c as usize] * absmax[b / NESTED_BLOCK] + offset)
                .collect(),
        }
    }

    /// Bytes the scales occupy.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Plain(v) => 4 * v.len(),
            Self::Nested { codes, absmax, .. } => codes.len() + 4 * absmax.len() + 4,
        }
    }
}

/// Why a 4-bit tensor could not be built from its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatError(pub String);

impl std::fmt::Display for FormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kiln::nf4: {}", self.0)
    }
}

impl std::error::Error for FormatError {}

/// A 4-bit quantized tensor on the host, in bitsandbytes' layout.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Packed4 {
    pub kind: QuantType,
    /// Values per absmax block.
    pub block: usize,
    /// Shape of the original tensor (a linear weight is `[out, in]`).
    pub shape: Vec<usize>,
    /// Two codes a byte, first element in the high nibble.
    pub data: Vec<u8>,
    pub absmax: Absmax,
}

impl Packed4 {
    /// Quantize row-major `values` of `shape`. `double_quant` compresses the scales as
    /// bitsandbytes' `compress_statistics=True` does.
    pub fn quantize(values: &[f32], shape: &[usize], kind: QuantType, block: usize, double_quant: bool) -> Result<Self, FormatError> {
        check_layout(values.len(), shape, block)?;
        let mut data = vec![0u8; values.len() / 2];
        let absmax = quantize_blocks(values, block, |x| kind.quantize(x), |i, c| data[i / 2] |= if i.is_multiple_of(2) { c << 4 } else { c });
        let absmax = if double_quant { Absmax::nested(&absmax) } else { Absmax::Plain(absmax) };
        Ok(Self { kind, block, shape: shape.to_vec(), data, absmax })
    }

    /// Assemble a tensor from stored parts (a checkpoint's `weight`, `absmax`, …), checking that
    /// the parts agree with each other.
    pub fn from_parts(kind: QuantType, block: usize, shape: &[usize], data: Vec<u8>, absmax: Absmax) -> Result<Self, FormatError> {
        let n: usize = shape.iter().product();
        check_layout(n, shape, block)?;
        if data.len() != n / 2 {
            return Err(FormatError(format!("packed data has {} bytes; shape {shape:?} needs {}", data.len(), n / 2)));
        }
        let blocks = n.div_ceil(block);
        if absmax.blocks() != blocks {
            return Err(FormatError(format!("absmax has {} blocks; shape {shape:?} at block {block} needs {blocks}", absmax.blocks())));
        }
        if let Absmax::Nested { codes, absmax, .. } = &absmax {
            let groups = codes.len().div_ceil(NESTED_BLOCK);
            if absmax.len() != groups {
                return Err(FormatError(format!("nested absmax has {} values; {} codes need {groups}", absmax.len(), codes.len())));
            }
        }
        Ok(Self { kind, block, shape: shape.to_vec(), data, absmax })
    }

    /// Number of quantized values.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The code of element `i`.
    pub fn code_at(&self, i: usize) -> u8 {
        let byte = self.data[i / 2];
        if i.is_multiple_of(2) { byte >> 4 } else { byte & 0x0f }
    }

    /// The dequantized values in f32 (code value × block absmax, as bitsandbytes computes them).
    pub fn dequantize(&self) -> Vec<f32> {
        let (code, scales) = (self.kind.code(), self.absmax.values());
        (0..self.len()).map(|i| code[self.code_at(i) as usize] * scales[i / self.block]).collect()
    }

    /// The packed bytes as little-endian u32 words (8 codes a word, zero-padded), the device
    /// layout: element `i` sits in word `i / 8` at bit `8 · (i / 2 % 4) + 4 · (1 − i % 2)`.
    pub fn words(&self) -> Vec<u32> {
        bytes_to_words(&self.data)
    }

    /// Bytes of the packed codes and scales.
    pub fn bytes(&self) -> usize {
        self.data.len() + self.absmax.bytes()
    }

    /// Storage bits per quantized value (≈ 4.127 at block 64 with double quantization).
    pub fn bits_per_value(&self) -> f64 {
        8.0 * self.bytes() as f64 / self.len().max(1) as f64
    }
}

/// Little-endian u32 words of `bytes`, zero-padded to a whole word.
pub fn bytes_to_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// The first `len` bytes of little-endian u32 `words`.
pub fn words_to_bytes(words: &[u32], len: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes.truncate(len);
    bytes
}

/// A block size bitsandbytes accepts and an element count it can pack.
pub(crate) fn check_layout(n: usize, shape: &[usize], block: usize) -> Result<(), FormatError> {
    if !BLOCK_SIZES.contains(&block) {
        return Err(FormatError(format!("block size {block} is not one of {BLOCK_SIZES:?}")));
    }
    if n == 0 || !n.is_multiple_of(2) {
        return Err(FormatError(format!("shape {shape:?} has {n} elements; 4-bit packing needs a positive even count")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_to_their_own_values() {
        for kind in [QuantType::Nf4, QuantType::Fp4] {
            for (c, &v) in kind.code().iter().enumerate() {
                // −0 of FP4 quantizes to +0's code: bitsandbytes takes the sign from `x < 0`.
                let expected = if kind == QuantType::Fp4 && c == 8 { 0 } else { c as u8 };
                assert_eq!(kind.quantize(v), expected, "{kind:?} code {c} ({v})");
            }
        }
        for (c, &v) in DYNAMIC_CODE.iter().enumerate() {
            assert_eq!(quantize_dynamic(v) as usize, c, "dynamic code {c} ({v})");
        }
    }

    #[test]
    fn nearest_value_except_at_the_thresholds() {
        // Every threshold lies between its neighbours' values (they are midpoints, rounded).
        for w in NF4_THRESHOLDS.windows(2) {
            assert!(w[0] < w[1]);
        }
        for x in (-1000..=1000).map(|i| i as f32 / 1000.0) {
            let c = QuantType::Nf4.quantize(x) as usize;
            let best = NF4_CODE.iter().map(|v| (v - x).abs()).fold(f32::MAX, f32::min);
            assert!((NF4_CODE[c] - x).abs() <= best + 1e-6, "x {x}: code {c}");
        }
    }

    #[test]
    fn zero_blocks_and_nan_follow_bitsandbytes() {
        let p = Packed4::quantize(&[0.0; 64], &[64], QuantType::Nf4, 64, false).unwrap();
        assert_eq!(p.absmax, Absmax::Plain(vec![0.0]));
        assert!(p.data.iter().all(|&b| b == 0x00), "0 · (1/0) is NaN, which takes code 0");
        assert_eq!(QuantType::Fp4.quantize(f32::NAN), 0);
        assert_eq!(quantize_dynamic(f32::NAN), 0);
    }

    #[test]
    fn words_round_trip_and_place_the_first_element_high() {
        let p = Packed4::quantize(&[1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5], &[10], QuantType::Nf4, 32, false).unwrap();
        assert_eq!(p.data[0], 0xf0);
        let words = p.words();
        assert_eq!(words.len(), 2);
        assert_eq!(words[0] & 0xff, 0xf0);
        assert_eq!(words_to_bytes(&words, p.data.len()), p.data);
    }

    #[test]
    fn double_quantization_is_about_4_127_bits() {
        let values: Vec<f32> = (0..64 * 1024).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
        let p = Packed4::quantize(&values, &[256, 256], QuantType::Nf4, 64, true).unwrap();
        assert!((p.bits_per_value() - 4.127).abs() < 0.005, "{}", p.bits_per_value());
        let plain = Packed4::quantize(&values, &[256, 256], QuantType::Nf4, 64, false).unwrap();
        assert_eq!(plain.bits_per_value(), 4.5);
    }

    #[test]
    fn layouts_off_the_list_are_refused() {
        assert!(Packed4::quantize(&[1.0; 64], &[64], QuantType::Nf4, 48, false).unwrap_err().0.contains("block size 48"));
        assert!(Packed4::quantize(&[1.0; 63], &[63], QuantType::Nf4, 64, false).unwrap_err().0.contains("even"));
        let p = Packed4::quantize(&[1.0; 128], &[128], QuantType::Nf4, 64, false).unwrap();
        let err = Packed4::from_parts(QuantType::Nf4, 64, &[128], p.data.clone(), Absmax::Plain(vec![1.0])).unwrap_err();
        assert!(err.0.contains("absmax has 1 blocks") && err.0.contains("needs 2"), "{err}");
        assert!(Packed4::from_parts(QuantType::Nf4, 64, &[128], vec![0; 63], p.absmax).unwrap_err().0.contains("63 bytes"));
    }
}
