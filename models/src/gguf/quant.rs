//! GGML tensor types and their dequantization to f32.
//!
//! Each supported type reproduces ggml's reference `dequantize_row_*` (ggml-quants.c) operation by
//! operation in f32 (Rust never fuses a multiply and an add), so the values are bit-exact with it
//! and with gguf-py's `gguf.quants.dequantize`.
//!
//! Block layouts (little-endian, `f16` = IEEE half):
//! - `Q4_0`, 32 values in 18 bytes: `d: f16`, `qs: [u8; 16]`; value `j < 16` is the low nibble of
//!   `qs[j]`, value `j + 16` its high nibble; `y = (q - 8) * d`.
//! - `Q8_0`, 32 values in 34 bytes: `d: f16`, `qs: [i8; 32]`; `y = q * d`.
//! - `Q4_K`, 256 values in 144 bytes: `d: f16`, `dmin: f16`, `scales: [u8; 12]` (8 six-bit scales and
//!   8 six-bit mins, see `scale_min_k4`), `qs: [u8; 128]`. Each 64 values use 32 bytes of `qs`:
//!   the low nibbles are sub-block `2i`, the high nibbles sub-block `2i + 1`;
//!   `y = (d * sc) * q - (dmin * m)`.
//! - `Q6_K`, 256 values in 210 bytes: `ql: [u8; 128]` (low 4 bits), `qh: [u8; 64]` (high 2 bits),
//!   `scales: [i8; 16]`, `d: f16`; `y = (d * sc) * (q - 32)`, layout in `dequantize_q6_k`.
//! - `TQ1_0`, `TQ2_0` (ternary, `y = (t − 1) * d`): layouts in `super::ternary`.
//! - `BF16`: the upper half of an f32; `F16`: IEEE half; `F32`.

use half::f16;

/// Values per super-block of the k-quants.
pub const QK_K: usize = 256;

/// A ggml tensor type, with its GGUF id, block size (values) and block size (bytes).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// (type, id, name, values per block, bytes per block), from ggml's type traits.
const TYPES: &[(GgmlType, u32, &str, usize, usize)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2_K, 10, "Q2_K", QK_K, 84),
    (GgmlType::Q3_K, 11, "Q3_K", QK_K, 110),
    (GgmlType::Q4_K, 12, "Q4_K", QK_K, 144),
    (GgmlType::Q5_K, 13, "Q5_K", QK_K, 176),
    (GgmlType::Q6_K, 14, "Q6_K", QK_K, 210),
    (GgmlType::Q8_K, 15, "Q8_K", QK_K, 292),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", QK_K, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", QK_K, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", QK_K, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", QK_K, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", QK_K, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", QK_K, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", QK_K, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", QK_K, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", QK_K, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", QK_K, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
    (GgmlType::NVFP4, 40, "NVFP4", 64, 36),
    (GgmlType::Q1_0, 41, "Q1_0", 128, 18),
];

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        // Every variant has exactly one row (checked by a unit test).
        TYPES.iter().find(|e| e.0 == self).unwrap_or(&TYPES[0])
    }

    /// The type with GGUF/ggml id `id`, if known.
    pub fn from_id(id: u32) -> Option<Self> {
        TYPES.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    /// The GGUF/ggml id.
    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// ggml's name (`"Q4_K"`).
    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Values per block (1 for plain types).
    pub fn block_size(self) -> usize {
        self.entry().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.entry().4
    }

    /// Whether [`dequantize`] converts this type.
    pub fn can_dequantize(self) -> bool {
        matches!(
            self,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q4_0
                | GgmlType::Q8_0
                | GgmlType::Q4_K
                | GgmlType::Q6_K
                | GgmlType::TQ1_0
                | GgmlType::TQ2_0
        )
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[inline]
fn half(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block's 12 scale bytes
/// (ggml's `get_scale_min_k4`): sub-blocks 0..4 keep theirs in the low 6 bits of bytes `j` (scale)
/// and `j + 4` (min); sub-blocks 4..8 in the nibbles of byte `j + 4` (scale low, min high), with
/// the two high bits in the top bits of bytes `j - 4` (scale) and `j` (min).
#[inline]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn dequantize_q4_0(data: &[u8], out: &mut Vec<f32>) {
    for block in data.chunks_exact(18) {
        let d = half(block, 0);
        let qs = &block[2..18];
        out.extend(qs.iter().map(|&q| ((q & 0x0F) as i32 - 8) as f32 * d));
        out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
    }
}

fn dequantize_q8_0(data: &[u8], out: &mut Vec<f32>) {
    for block in data.chunks_exact(34) {
        let d = half(block, 0);
        out.extend(block[2..34].iter().map(|&q| (q as i8) as f32 * d));
    }
}

fn dequantize_q4_k(data: &[u8], out: &mut Vec<f32>) {
    for block in data.chunks_exact(144) {
        let d = half(block, 0);
        let dmin = half(block, 2);
        let scales = &block[4..16];
        let qs = &block[16..144];
        for (i, chunk) in qs.chunks_exact(32).enumerate() {
            let (sc, m) = scale_min_k4(2 * i, scales);
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            let (sc, m) = scale_min_k4(2 * i + 1, scales);
            let (d2, m2) = (d * sc as f32, dmin * m as f32);
            out.extend(chunk.iter().map(|&q| d1 * (q & 0x0F) as f32 - m1));
            out.extend(chunk.iter().map(|&q| d2 * (q >> 4) as f32 - m2));
        }
    }
}

/// Q6_K: each half super-block (128 values) uses 64 bytes of `ql`, 32 of `qh` and 8 scales. For
/// `l < 32`, values `l`, `l + 32`, `l + 64`, `l + 96` take the low nibble of `ql[l]`, the low nibble
/// of `ql[l + 32]`, the high nibble of `ql[l]`, the high nibble of `ql[l + 32]`, with bits 0-1, 2-3,
/// 4-5, 6-7 of `qh[l]` on top; their scales are `sc[l / 16 + 0, 2, 4, 6]`.
fn dequantize_q6_k(data: &[u8], out: &mut Vec<f32>) {
    for block in data.chunks_exact(210) {
        let d = half(block, 208);
        let mut y = [0f32; QK_K];
        for n in 0..2 {
            let ql = &block[64 * n..64 * n + 64];
            let qh = &block[128 + 32 * n..128 + 32 * n + 32];
            let sc = &block[192 + 8 * n..192 + 8 * n + 8];
            let y = &mut y[128 * n..128 * n + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
            }
        }
        out.extend_from_slice(&y);
    }
}

/// Dequantizes `data`, a whole number of `ty` blocks, to f32 in storage order. Errors (with a
/// message) on a type not supported here or a length that is not a whole number of blocks.
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Result<Vec<f32>, String> {
    if !ty.can_dequantize() {
        return Err(format!(
            "dequantization of ggml type {ty} is not supported (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q6_K, TQ1_0, TQ2_0 are)"
        ));
    }
    let (block, size) = (ty.block_size(), ty.type_size());
    if !data.len().is_multiple_of(size) {
        return Err(format!("{} bytes is not a whole number of {ty} blocks of {size} bytes", data.len()));
    }
    let n = data.len() / size * block;
    let mut out = Vec::with_capacity(n);
    match ty {
        GgmlType::F32 => out.extend(data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        GgmlType::F16 => out.extend(data.chunks_exact(2).map(|b| half(b, 0))),
        GgmlType::BF16 => {
            out.extend(data.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)))
        }
        GgmlType::Q4_0 => dequantize_q4_0(data, &mut out),
        GgmlType::Q8_0 => dequantize_q8_0(data, &mut out),
        GgmlType::Q4_K => dequantize_q4_k(data, &mut out),
        GgmlType::Q6_K => dequantize_q6_k(data, &mut out),
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => {
            let (codes, scales) = super::ternary::decode(ty, data)?;
            out.extend(codes.iter().enumerate().map(|(i, &t)| (t as f32 - 1.0) * scales[i / QK_K]));
        }
        _ => unreachable!("checked by can_dequantize"),
    }
    debug_assert_eq!(out.len(), n);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    #[test]
    fn type_table_is_consistent() {
        for (i, e) in TYPES.iter().enumerate() {
            assert_eq!(GgmlType::from_id(e.1), Some(e.0));
            assert_eq!(e.0.id(), e.1);
            assert_eq!(e.0.name(), e.2);
            assert!(TYPES[i + 1..].iter().all(|o| o.0 != e.0 && o.1 != e.1), "duplicate {}", e.2);
        }
        assert_eq!(GgmlType::from_id(4), None); // removed Q4_2
        assert_eq!(GgmlType::from_id(31), None);
        assert_eq!(GgmlType::from_id(u32::MAX), None);
        // The sizes of the supported types, from ggml-common.h's static asserts.
        assert_eq!((GgmlType::Q4_0.block_size(), GgmlType::Q4_0.type_size()), (32, 2 + 16));
        assert_eq!((GgmlType::Q8_0.block_size(), GgmlType::Q8_0.type_size()), (32, 2 + 32));
        assert_eq!((GgmlType::Q4_K.block_size(), GgmlType::Q4_K.type_size()), (256, 2 + 2 + 12 + 128));
        assert_eq!((GgmlType::Q6_K.block_size(), GgmlType::Q6_K.type_size()), (256, 128 + 64 + 16 + 2));
        assert_eq!(GgmlType::Q4_K.to_string(), "Q4_K");
    }

    #[test]
    fn plain_types() {
        let xs = [0.0f32, -1.5, 3.25e-3, f32::MAX, f32::MIN_POSITIVE, -0.0, 65504.0];
        let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let y = dequantize(GgmlType::F32, &bytes).unwrap();
        assert_eq!(
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            xs.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );

        // Every half, including subnormals, infinities and NaN, widens exactly.
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        let y = dequantize(GgmlType::F16, &all).unwrap();
        for (b, v) in (0..=u16::MAX).zip(&y) {
            let expect = f16::from_bits(b).to_f32();
            assert!(v.to_bits() == expect.to_bits() || (v.is_nan() && expect.is_nan()), "f16 {b:#x}");
        }
        assert_eq!(y[0x3C00], 1.0);
        assert_eq!(y[0xC000], -2.0);
        assert_eq!(y[0x0001], 2f32.powi(-24));

        let y = dequantize(GgmlType::BF16, &all).unwrap();
        for (b, v) in (0..=u16::MAX).zip(&y) {
            assert_eq!(v.to_bits(), (b as u32) << 16, "bf16 {b:#x}");
        }
        assert_eq!(y[0x3F80], 1.0);
        assert_eq!(y[0xC040], -3.0);
    }

    #[test]
    fn q8_0_block_layout() {
        let mut block = Vec::new();
        block.extend(h(0.5));
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = dequantize(GgmlType::Q8_0, &block).unwrap();
        assert_eq!(y.len(), 32);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, (i as f32 - 16.0) * 0.5);
        }
        // -128 is a valid code.
        block[2] = 0x80;
        assert_eq!(dequantize(GgmlType::Q8_0, &block).unwrap()[0], -64.0);
    }

    #[test]
    fn q4_0_block_layout() {
        let mut block = Vec::new();
        block.extend(h(2.0));
        // Byte j: low nibble j (value j), high nibble 15 - j (value j + 16).
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dequantize(GgmlType::Q4_0, &block).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 2.0, "low nibble {j}");
            assert_eq!(y[j + 16], ((15 - j) as f32 - 8.0) * 2.0, "high nibble {j}");
        }
    }

    /// Packs 8 six-bit scales and mins the way ggml's Q4_K quantizer does.
    fn pack_scale_min_k4(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
        let mut q = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                q[j] = sc[j];
                q[j + 4] = m[j];
            } else {
                q[j + 4] = (sc[j] & 0x0F) | ((m[j] & 0x0F) << 4);
                q[j - 4] |= (sc[j] >> 4) << 6;
                q[j] |= (m[j] >> 4) << 6;
            }
        }
        q
    }

    #[test]
    fn q4_k_scale_packing_round_trips() {
        let sc = [1, 63, 17, 32, 63, 5, 48, 0];
        let m = [0, 62, 33, 1, 40, 63, 7, 31];
        let q = pack_scale_min_k4(sc, m);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &q), (sc[j], m[j]), "sub-block {j}");
        }
    }

    #[test]
    fn q4_k_block_layout() {
        let sc = [1, 2, 3, 4, 60, 61, 62, 63];
        let m = [5, 0, 63, 7, 8, 33, 10, 1];
        let (d, dmin) = (0.25f32, 0.125f32);
        let mut block = Vec::new();
        block.extend(h(d));
        block.extend(h(dmin));
        block.extend(pack_scale_min_k4(sc, m));
        // Value v of the super-block has code (v * 7) % 16.
        let code = |v: usize| ((v * 7) % 16) as u8;
        for chunk in 0..4 {
            for l in 0..32 {
                block.push(code(64 * chunk + l) | (code(64 * chunk + 32 + l) << 4));
            }
        }
        assert_eq!(block.len(), 144);
        let y = dequantize(GgmlType::Q4_K, &block).unwrap();
        assert_eq!(y.len(), 256);
        for (v, got) in y.iter().enumerate() {
            let s = v / 32;
            let expect = (d * sc[s] as f32) * code(v) as f32 - dmin * m[s] as f32;
            assert_eq!(got.to_bits(), expect.to_bits(), "value {v}");
        }
    }

    #[test]
    fn q6_k_block_layout() {
        let scales: [i8; 16] = [1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, -12, 13, -14, 127, -128];
        let d = 0.0625f32;
        // Value v has the 6-bit code (v * 37) % 64.
        let code = |v: usize| ((v * 37) % 64) as u8;
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for v in 0..256 {
            let (n, r) = (v / 128, v % 128);
            let (quarter, l) = (r / 32, r % 32);
            let q = code(v);
            let ql_at = 64 * n + l + if quarter % 2 == 1 { 32 } else { 0 };
            ql[ql_at] |= if quarter < 2 { q & 0x0F } else { (q & 0x0F) << 4 };
            qh[32 * n + l] |= (q >> 4) << (2 * quarter);
        }
        let mut block = Vec::new();
        block.extend(ql);
        block.extend(qh);
        block.extend(scales.iter().map(|&s| s as u8));
        block.extend(h(d));
        assert_eq!(block.len(), 210);
        let y = dequantize(GgmlType::Q6_K, &block).unwrap();
        for (v, got) in y.iter().enumerate() {
            let s = v / 16; // 16 values per scale, in order
            let expect = d * scales[s] as f32 * (code(v) as i32 - 32) as f32;
            assert_eq!(got.to_bits(), expect.to_bits(), "value {v}");
        }
    }

    /// ggml's reference Q8_0 quantizer (`quantize_row_q8_0_ref`): d = amax / 127, q = round(x / d).
    fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        for b in x.chunks_exact(32) {
            let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out.extend(h(d));
            out.extend(b.iter().map(|v| ((v * id).round() as i8) as u8));
        }
        out
    }

    /// ggml's reference Q4_0 quantizer: d = max / -8 (max: the value of largest magnitude),
    /// q = min(15, trunc(x / d + 8.5)).
    fn quantize_q4_0(x: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        for b in x.chunks_exact(32) {
            let max = b.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out.extend(h(d));
            let q = |v: f32| ((v * id + 8.5) as u8).min(15);
            out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
        }
        out
    }

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    #[test]
    fn q8_0_round_trip() {
        let x = pseudo_random(32 * 8, 7);
        let y = dequantize(GgmlType::Q8_0, &quantize_q8_0(&x)).unwrap();
        for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (a, b2) in xb.iter().zip(yb) {
                // Half a step of d, plus d's own f16 rounding.
                assert!((a - b2).abs() <= amax / 127.0 * 0.5 + amax * 1e-3, "block {b}: {a} vs {b2}");
            }
        }
        let zeros = dequantize(GgmlType::Q8_0, &quantize_q8_0(&[0.0; 32])).unwrap();
        assert!(zeros.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn q4_0_round_trip() {
        let x = pseudo_random(32 * 8, 99);
        let y = dequantize(GgmlType::Q4_0, &quantize_q4_0(&x)).unwrap();
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (a, b) in xb.iter().zip(yb) {
                // Half a step (amax / 16), except that the code for +8 steps is clamped to 7 steps.
                assert!((a - b).abs() <= amax / 8.0 + amax * 2e-3, "{a} vs {b}");
            }
            // The value of largest magnitude is exact up to d's f16 rounding (code 0 = -8 d = max).
            let i = (0..32).max_by(|&i, &j| xb[i].abs().total_cmp(&xb[j].abs())).unwrap();
            assert!((xb[i] - yb[i]).abs() <= amax * 1e-3);
        }
    }

    #[test]
    fn rejects_partial_blocks_and_unsupported_types() {
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33]).is_err());
        assert!(dequantize(GgmlType::Q4_K, &[0u8; 145]).is_err());
        assert!(dequantize(GgmlType::F32, &[0u8; 3]).is_err());
        let e = dequantize(GgmlType::Q5_K, &[0u8; 176]).unwrap_err();
        assert!(e.contains("Q5_K"), "{e}");
        assert_eq!(dequantize(GgmlType::Q6_K, &[]).unwrap(), Vec::<f32>::new());
    }
}
