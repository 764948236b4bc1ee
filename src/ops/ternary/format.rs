//! BitNet b1.58 on the host: ternary weights with absmean scales, 8-bit activations with per-token
//! absmax scales, kiln's 2-bit packing and HF's `BitNetForCausalLM` packing. This is the exact
//! oracle of every device path (integer codes and i32 accumulators equal, then one scale step
//! computed the same way everywhere).
//!
//! Quantizers (as HF's `WeightQuant`/`ActQuant` and BitNet's training code compute them, in f32,
//! rounding half to even as `torch.round` does):
//! - weight: `s = 1 / max(mean|W|, 1e-5)` per group of output rows, `q = clamp(round(w · s), −1, 1)`,
//!   `w ≈ q / s`;
//! - activation row: `s = 127 / max(max|x|, 1e-5)`, `q = clamp(round(x · s), −128, 127)`.
//!
//! A product is `y[m, n] = acc[m, n] / (s_x[m] · s_w[n])` with the exact integer
//! `acc = Σ_k q_x · q_w` (HF's `post_quant_process`).
//!
//! Packing (kiln's, chosen for the decode kernel): a weight row of `k` codes is padded to a
//! multiple of 64 and stored as u32 words of 16 codes, `w + 1 ∈ {0, 1, 2}` (padding holds 1, a
//! zero weight). Code `i` of a word sits at bit `8 · (i % 4) + 2 · (i / 4)`, so
//! `(word >> 2j) & 0x03030303` gives the codes of elements `4j … 4j+3` as the four bytes that a
//! 4-way byte dot product (`dp4a`) multiplies with one word of four int8 activations. Activations
//! are packed four int8 a word along `k`, padded with zeros to the same 64-element granule.

use std::fmt;

/// Floor of `mean|W|` in the weight scale.
pub const WEIGHT_EPS: f32 = 1e-5;
/// Floor of `max|x|` in the activation scale.
pub const ACT_EPS: f32 = 1e-5;
/// The largest activation code.
pub const ACT_MAX: f32 = 127.0;
/// Codes in a packed weight word.
pub const CODES_PER_WORD: usize = 16;
/// Rows are padded to whole multiples of this many elements (one 16-byte vector of weight words).
pub const ROW_GRANULE: usize = 64;

/// A malformed ternary weight or a mismatched input, naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TernaryError(pub String);

impl fmt::Display for TernaryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kiln::ternary: {}", self.0)
    }
}

impl std::error::Error for TernaryError {}

fn fail<T>(message: String) -> Result<T, TernaryError> {
    Err(TernaryError(message))
}

/// Shape of a ternary weight `[n, k]` (`n` output features) and its scale groups: every `group`
/// consecutive output rows share one scale (`group = n`: one scale per tensor, BitNet's choice;
/// `group = 1`: per output channel). Grouping by output rows keeps a product's scale step one
/// multiply per output, after the integer sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TernaryLayout {
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

impl TernaryLayout {
    /// A layout, checked: nonzero sizes and a group of at least one row.
    pub fn new(n: usize, k: usize, group: usize) -> Result<Self, TernaryError> {
        if n == 0 || k == 0 {
            return fail(format!("a weight needs nonzero sizes, got [{n}, {k}]"));
        }
        if group == 0 || group > n {
            return fail(format!("scale groups of {group} rows do not fit a weight of {n} rows (1 ≤ group ≤ n)"));
        }
        Ok(Self { n, k, group })
    }

    /// Number of scales (the last group may be short).
    pub fn groups(&self) -> usize {
        self.n.div_ceil(self.group)
    }

    /// `k` padded to the row granule.
    pub fn padded_k(&self) -> usize {
        padded(self.k)
    }

    /// Packed words per weight row.
    pub fn row_words(&self) -> usize {
        self.padded_k() / CODES_PER_WORD
    }

    /// Packed words of the whole weight.
    pub fn words(&self) -> usize {
        self.n * self.row_words()
    }

    /// Device bytes of the packed weight and its scales.
    pub fn bytes(&self) -> usize {
        4 * self.words() + 4 * self.groups()
    }
}

/// `k` rounded up to [`ROW_GRANULE`].
pub fn padded(k: usize) -> usize {
    k.div_ceil(ROW_GRANULE) * ROW_GRANULE
}

/// Activation words per row for `k` features (four int8 a word).
pub fn act_row_words(k: usize) -> usize {
    padded(k) / 4
}

/// The weight scale of a group whose mean absolute value is `mean_abs`.
pub fn weight_scale(mean_abs: f32) -> f32 {
    1.0 / mean_abs.max(WEIGHT_EPS)
}

/// The ternary code of `w` under scale `s` (NaN gives 0).
pub fn weight_code(w: f32, s: f32) -> i8 {
    (w * s).round_ties_even().clamp(-1.0, 1.0) as i8
}

/// The activation scale of a row whose largest magnitude is `abs_max`.
pub fn act_scale(abs_max: f32) -> f32 {
    ACT_MAX / abs_max.max(ACT_EPS)
}

/// The int8 code of `x` under scale `s` (NaN gives 0).
pub fn act_code(x: f32, s: f32) -> i8 {
    (x * s).round_ties_even().clamp(-128.0, 127.0) as i8
}

/// One output of a product from its integer sum and the two scales.
pub fn rescale(acc: i32, act_scale: f32, weight_scale: f32) -> f32 {
    acc as f32 / (act_scale * weight_scale)
}

/// Bit offset of code `i` (0..16) in its word.
pub const fn code_shift(i: usize) -> usize {
    8 * (i % 4) + 2 * (i / 4)
}

/// A packed ternary weight on the host.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TernaryMatrix {
    pub layout: TernaryLayout,
    /// `n · row_words` packed words (see the module docs).
    pub words: Vec<u32>,
    /// One weight scale per group: `w ≈ q / s`.
    pub scales: Vec<f32>,
}

impl TernaryMatrix {
    /// Quantize a row-major `[n, k]` weight with absmean scales per group (the mean summed in
    /// f64, so the host result does not depend on a summation order).
    pub fn quantize(weight: &[f32], layout: TernaryLayout) -> Result<Self, TernaryError> {
        check_len("weight", weight.len(), layout.n * layout.k)?;
        let rows_per = layout.group * layout.k;
        let scales = weight
            .chunks(rows_per)
            .map(|g| weight_scale((g.iter().map(|w| w.abs() as f64).sum::<f64>() / g.len() as f64) as f32))
            .collect::<Vec<_>>();
        Self::quantize_with_scales(weight, layout, scales)
    }

    /// Quantize with given scales (how the device's codes are checked: its scales come from a
    /// device reduction whose summation order the host does not reproduce).
    pub fn quantize_with_scales(weight: &[f32], layout: TernaryLayout, scales: Vec<f32>) -> Result<Self, TernaryError> {
        check_len("weight", weight.len(), layout.n * layout.k)?;
        check_len("scales", scales.len(), layout.groups())?;
        let codes = weight
            .chunks(layout.k)
            .enumerate()
            .flat_map(|(row, values)| {
                let s = scales[row / layout.group];
                values.iter().map(move |&w| weight_code(w, s))
            })
            .collect::<Vec<_>>();
        Self::from_codes(&codes, layout, scales)
    }

    /// Pack row-major codes in {−1, 0, 1}.
    pub fn from_codes(codes: &[i8], layout: TernaryLayout, scales: Vec<f32>) -> Result<Self, TernaryError> {
        check_len("codes", codes.len(), layout.n * layout.k)?;
        check_len("scales", scales.len(), layout.groups())?;
        if let Some(bad) = codes.iter().find(|c| !(-1..=1).contains(*c)) {
            return fail(format!("code {bad} is not ternary"));
        }
        let row_words = layout.row_words();
        let mut words = vec![pad_word(); layout.words()];
        for (row, values) in codes.chunks(layout.k).enumerate() {
            for (j, &c) in values.iter().enumerate() {
                let (w, i) = (row * row_words + j / CODES_PER_WORD, j % CODES_PER_WORD);
                words[w] = (words[w] & !(3 << code_shift(i))) | (((c + 1) as u32) << code_shift(i));
            }
        }
        Ok(Self { layout, words, scales })
    }

    /// Build from packed words, checking their count and that every code is 0, 1 or 2 (the
    /// padding included).
    pub fn from_words(words: Vec<u32>, layout: TernaryLayout, scales: Vec<f32>) -> Result<Self, TernaryError> {
        check_len("words", words.len(), layout.words())?;
        check_len("scales", scales.len(), layout.groups())?;
        if let Some(at) = words.iter().position(|&w| (w >> 1) & w & 0x5555_5555 != 0) {
            return fail(format!("word {at} ({:#010x}) holds code 3, which is not a ternary code", words[at]));
        }
        Ok(Self { layout, words, scales })
    }

    /// The row-major codes `[n, k]`.
    pub fn codes(&self) -> Vec<i8> {
        let l = self.layout;
        let row_words = l.row_words();
        (0..l.n)
            .flat_map(|row| (0..l.k).map(move |j| (row, j)))
            .map(|(row, j)| {
                let word = self.words[row * row_words + j / CODES_PER_WORD];
                ((word >> code_shift(j % CODES_PER_WORD)) & 3) as i8 - 1
            })
            .collect()
    }

    /// The scale of output row `row`.
    pub fn row_scale(&self, row: usize) -> f32 {
        self.scales[row / self.layout.group]
    }

    /// The float weight `[n, k]`: `q / s`.
    pub fn dequantize(&self) -> Vec<f32> {
        let k = self.layout.k;
        self.codes().iter().enumerate().map(|(i, &c)| c as f32 / self.row_scale(i / k)).collect()
    }

    /// `y = x · Wᵀ` for row-major activations `[m, k]` as the W2A8 kernels compute it.
    pub fn matmul(&self, x: &[f32]) -> Result<Vec<f32>, TernaryError> {
        let acts = QuantizedActs::quantize(x, self.layout.k)?;
        let acc = self.accumulate(&acts);
        let n = self.layout.n;
        Ok(acc.iter().enumerate().map(|(i, &a)| rescale(a, acts.scales[i / n], self.row_scale(i % n))).collect())
    }

    /// The exact integer sums `Σ_k q_x · q_w`, `[m, n]`.
    pub fn accumulate(&self, acts: &QuantizedActs) -> Vec<i32> {
        let (codes, k) = (self.codes(), self.layout.k);
        acts.codes
            .chunks(k)
            .flat_map(|xr| codes.chunks(k).map(move |wr| xr.iter().zip(wr).map(|(&a, &b)| a as i32 * b as i32).sum()))
            .collect()
    }

    /// HF `BitNetForCausalLM`'s packing of this weight (`[⌈n/4⌉, k]` bytes: output row
    /// `i · ⌈n/4⌉ + r` at bits `2i` of byte row `r`, code `w + 1`) and its `weight_scale`. Needs
    /// one scale for the tensor.
    pub fn to_hf(&self) -> Result<(Vec<u8>, f32), TernaryError> {
        let l = self.layout;
        if l.groups() != 1 {
            return fail(format!("HF's BitNet layout has one scale per tensor; this weight has {} groups", l.groups()));
        }
        let rows = l.n.div_ceil(4);
        let mut bytes = vec![0u8; rows * l.k];
        for (row, values) in self.codes().chunks(l.k).enumerate() {
            let (slot, r) = (row / rows, row % rows);
            for (j, &c) in values.iter().enumerate() {
                bytes[r * l.k + j] |= ((c + 1) as u8) << (2 * slot);
            }
        }
        Ok((bytes, self.scales[0]))
    }

    /// Read HF's packing (see [`Self::to_hf`]) of a `[n, k]` weight: `bytes` is `[⌈n/4⌉, k]`.
    pub fn from_hf(bytes: &[u8], n: usize, k: usize, weight_scale: f32) -> Result<Self, TernaryError> {
        let layout = TernaryLayout::new(n, k, n)?;
        let rows = n.div_ceil(4);
        check_len("HF packed weight", bytes.len(), rows * k)?;
        let mut codes = vec![0i8; n * k];
        for (row, out) in codes.chunks_mut(k).enumerate() {
            let (slot, r) = (row / rows, row % rows);
            for (j, c) in out.iter_mut().enumerate() {
                let code = (bytes[r * k + j] >> (2 * slot)) & 3;
                if code == 3 {
                    return fail(format!("HF packed weight: byte [{r}, {j}] holds code 3 for row {row}"));
                }
                *c = code as i8 - 1;
            }
        }
        Self::from_codes(&codes, layout, vec![weight_scale])
    }
}

/// The word every code of which is 1 (a zero weight): padding.
const fn pad_word() -> u32 {
    0x5555_5555
}

/// Quantized activation rows on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedActs {
    pub k: usize,
    /// Row-major int8 codes `[m, k]`.
    pub codes: Vec<i8>,
    /// One scale per row.
    pub scales: Vec<f32>,
}

impl QuantizedActs {
    /// Quantize row-major `[m, k]` activations, one absmax scale per row.
    pub fn quantize(x: &[f32], k: usize) -> Result<Self, TernaryError> {
        if k == 0 || !x.len().is_multiple_of(k) {
            return fail(format!("{} activation values are not whole rows of {k}", x.len()));
        }
        let scales: Vec<f32> = x.chunks(k).map(|row| act_scale(row.iter().fold(0.0f32, |m, v| m.max(v.abs())))).collect();
        let codes = x.chunks(k).zip(&scales).flat_map(|(row, &s)| row.iter().map(move |&v| act_code(v, s))).collect();
        Ok(Self { k, codes, scales })
    }

    /// The codes packed four a word, rows padded to the granule (the device layout).
    pub fn words(&self) -> Vec<u32> {
        let row_words = act_row_words(self.k);
        let mut words = vec![0u32; self.scales.len() * row_words];
        for (row, values) in self.codes.chunks(self.k).enumerate() {
            for (j, &c) in values.iter().enumerate() {
                words[row * row_words + j / 4] |= (c as u8 as u32) << (8 * (j % 4));
            }
        }
        words
    }

    /// The dequantized activations `q / s`.
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes.iter().enumerate().map(|(i, &c)| c as f32 / self.scales[i / self.k]).collect()
    }
}

fn check_len(what: &str, got: usize, expected: usize) -> Result<(), TernaryError> {
    if got == expected { Ok(()) } else { fail(format!("{what} has {got} values, expected {expected}")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantizers_round_half_to_even_and_clamp() {
        assert_eq!(weight_code(0.5, 1.0), 0);
        assert_eq!(weight_code(1.5, 1.0), 1);
        assert_eq!(weight_code(-7.0, 1.0), -1);
        assert_eq!(act_code(2.5, 1.0), 2);
        assert_eq!(act_code(-300.0, 1.0), -128);
        assert_eq!(act_code(f32::NAN, 1.0), 0);
        assert_eq!(weight_scale(0.0), 1e5);
    }

    #[test]
    fn packing_round_trips_and_puts_dp4a_bytes_in_order() {
        let layout = TernaryLayout::new(3, 70, 2).unwrap();
        let codes: Vec<i8> = (0..210).map(|i| ((i * 7 + 3) % 3) as i8 - 1).collect();
        let m = TernaryMatrix::from_codes(&codes, layout, vec![1.0, 2.0]).unwrap();
        assert_eq!(m.codes(), codes);
        assert_eq!(m.words.len(), 3 * 8);
        // Byte b of (word >> 2j) & 0x03030303 is element 4j + b's code.
        let word = m.words[0];
        for j in 0..4 {
            let bytes = ((word >> (2 * j)) & 0x0303_0303).to_le_bytes();
            for (b, &byte) in bytes.iter().enumerate() {
                assert_eq!(byte as i8 - 1, codes[4 * j + b]);
            }
        }
        // Padding codes are zero weights.
        assert_eq!(m.words[5] >> code_shift(6) & 3, 1);
        assert!(TernaryMatrix::from_words(m.words.clone(), layout, vec![1.0, 2.0]).is_ok());
        let mut bad = m.words.clone();
        bad[1] |= 3 << 4;
        assert!(TernaryMatrix::from_words(bad, layout, vec![1.0, 2.0]).is_err());
    }

    #[test]
    fn hf_layout_round_trips() {
        for n in [4, 8, 12] {
            let layout = TernaryLayout::new(n, 5, n).unwrap();
            let codes: Vec<i8> = (0..n * 5).map(|i| ((i * 5 + 1) % 3) as i8 - 1).collect();
            let m = TernaryMatrix::from_codes(&codes, layout, vec![0.25]).unwrap();
            let (bytes, scale) = m.to_hf().unwrap();
            assert_eq!(bytes.len(), n / 4 * 5);
            assert_eq!(TernaryMatrix::from_hf(&bytes, n, 5, scale).unwrap(), m);
        }
        // HF's docstring example: byte 0b10100001 holds rows 0, 2, 4, 6 of column 0 as 0, −1, 1, 1.
        let m = TernaryMatrix::from_hf(&[0b1010_0001, 0, 0b1001_0000, 0], 8, 2, 1.0).unwrap();
        let c = m.codes();
        assert_eq!([c[0], c[4], c[8], c[12]], [0, -1, 1, 1]);
    }

    #[test]
    fn product_is_the_integer_sum_rescaled() {
        let layout = TernaryLayout::new(2, 3, 1).unwrap();
        let m = TernaryMatrix::from_codes(&[1, -1, 0, 0, 1, 1], layout, vec![2.0, 4.0]).unwrap();
        let x = [1.0f32, -0.5, 0.25];
        let y = m.matmul(&x).unwrap();
        let s = 127.0f32;
        // codes 127, -64 (−63.5 rounds to even), 32 (31.75).
        assert_eq!(y, vec![rescale(127 + 64, s, 2.0), rescale(-64 + 32, s, 4.0)]);
    }

    #[test]
    fn bad_inputs_are_named() {
        assert!(TernaryLayout::new(4, 0, 1).unwrap_err().0.contains("nonzero"));
        assert!(TernaryLayout::new(4, 4, 5).unwrap_err().0.contains("groups"));
        let layout = TernaryLayout::new(2, 2, 2).unwrap();
        assert!(TernaryMatrix::quantize(&[0.0; 3], layout).unwrap_err().0.contains("weight has 3"));
        assert!(TernaryMatrix::from_codes(&[2, 0, 0, 0], layout, vec![1.0]).unwrap_err().0.contains("not ternary"));
        assert!(QuantizedActs::quantize(&[0.0; 3], 2).is_err());
    }
}
