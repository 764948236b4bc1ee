//! llama.cpp's ternary GGUF types, TQ1_0 and TQ2_0 (blocks of 256 codes `t ∈ {0, 1, 2}` for
//! weights `(t − 1) · d`, one f16 `d` a block, stored last), read into codes and block scales and
//! written back, so a BitNet weight round-trips exactly (codes; its scale as the f16 `d`).
//!
//! - `TQ2_0`, 66 bytes: `qs: [u8; 64]`, `d`. Element `e` is bits `2l` of `qs[32·(e/128) + e%32]`
//!   with `l = (e%128)/32`.
//! - `TQ1_0`, 54 bytes: `qs: [u8; 48]`, `qh: [u8; 4]`, `d`. Five trits a byte in base 3, the first
//!   packed the most significant, the byte holding `⌈v · 256 / 243⌉`; trit `n` reads back as
//!   `((byte · 3ⁿ mod 256) · 3) >> 8`. Elements 0–159: trit `e/32` of `qs[e%32]`; 160–239: trit
//!   `(e−160)/16` of `qs[32 + (e−160)%16]`; 240–255: trit `(e−240)/4` of `qh[(e−240)%4]` (four
//!   trits, the fifth 0).

use half::f16;
use kiln::ops::ternary::{TernaryLayout, TernaryMatrix};

use super::quant::{GgmlType, QK_K};

/// Block bytes before `d` (TQ1_0: `qs` and `qh`).
const TQ1_0_BODY: usize = 52;
const TQ2_0_BODY: usize = 64;

/// Where element `e` of a TQ1_0 block lives: (byte index in the block, trit index in the byte).
fn tq1_0_place(e: usize) -> (usize, u32) {
    match e {
        0..160 => (e % 32, (e / 32) as u32),
        160..240 => (32 + (e - 160) % 16, ((e - 160) / 16) as u32),
        _ => (48 + (e - 240) % 4, ((e - 240) / 4) as u32),
    }
}

fn tq1_0_trit(byte: u8, n: u32) -> u8 {
    let q = byte.wrapping_mul(3u8.pow(n));
    ((q as u16 * 3) >> 8) as u8
}

/// The codes `t` (0..2) of whole TQ1_0/TQ2_0 blocks in storage order, and each block's `d`.
/// TQ2_0's unused code 3 is an error, as it is no ternary weight.
pub fn decode(ty: GgmlType, data: &[u8]) -> Result<(Vec<u8>, Vec<f32>), String> {
    let (size, body) = match ty {
        GgmlType::TQ1_0 => (GgmlType::TQ1_0.type_size(), TQ1_0_BODY),
        GgmlType::TQ2_0 => (GgmlType::TQ2_0.type_size(), TQ2_0_BODY),
        other => return Err(format!("{other} is not a ternary type")),
    };
    if !data.len().is_multiple_of(size) {
        return Err(format!("{} bytes is not a whole number of {ty} blocks of {size} bytes", data.len()));
    }
    let blocks = data.len() / size;
    let mut codes = Vec::with_capacity(blocks * QK_K);
    let mut scales = Vec::with_capacity(blocks);
    for (b, block) in data.chunks_exact(size).enumerate() {
        scales.push(f16::from_bits(u16::from_le_bytes([block[body], block[body + 1]])).to_f32());
        for e in 0..QK_K {
            let t = if ty == GgmlType::TQ2_0 {
                (block[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3
            } else {
                let (at, n) = tq1_0_place(e);
                tq1_0_trit(block[at], n)
            };
            if t > 2 {
                return Err(format!("{ty} block {b} element {e} holds code {t}, which is not ternary"));
            }
            codes.push(t);
        }
    }
    Ok((codes, scales))
}

/// Whole blocks of codes `t` (0..2; a multiple of 256) with one `d` a block, as `ty` stores them.
pub fn encode(ty: GgmlType, codes: &[u8], scales: &[f32]) -> Result<Vec<u8>, String> {
    if !codes.len().is_multiple_of(QK_K) || codes.len() / QK_K != scales.len() {
        return Err(format!("{} codes and {} scales are not whole {ty} blocks", codes.len(), scales.len()));
    }
    if codes.iter().any(|&t| t > 2) {
        return Err("a code above 2 is not ternary".into());
    }
    let mut out = Vec::with_capacity(scales.len() * ty.type_size());
    for (block, &d) in codes.chunks_exact(QK_K).zip(scales) {
        let start = out.len();
        match ty {
            GgmlType::TQ2_0 => {
                out.resize(start + TQ2_0_BODY, 0);
                for (e, &t) in block.iter().enumerate() {
                    out[start + 32 * (e / 128) + e % 32] |= t << (2 * ((e % 128) / 32));
                }
            }
            GgmlType::TQ1_0 => {
                let mut values = [0u16; TQ1_0_BODY];
                let mut trits = [0u8; TQ1_0_BODY];
                for (e, &t) in block.iter().enumerate() {
                    let (at, _) = tq1_0_place(e);
                    values[at] = values[at] * 3 + t as u16;
                    trits[at] += 1;
                }
                // The four-trit bytes shift their first trit to the top (a fifth trit of 0).
                out.extend(values.iter().zip(&trits).map(|(&v, &n)| {
                    let v = v * 3u16.pow(5 - n as u32);
                    ((v * 256 + 242) / 243) as u8
                }));
            }
            other => return Err(format!("{other} is not a ternary type")),
        }
        out.extend(f16::from_f32(d).to_bits().to_le_bytes());
    }
    Ok(out)
}

/// A `[n, k]` row-major weight that takes ternary values, `{−m, 0, +m}` with one magnitude `m`
/// a row, as a packed ternary matrix with row scale `1 / m` (one scale for the tensor when every
/// row has the same `m`; an all-zero row takes the others'). This is how a `bitnet` GGUF holds a
/// BitNet weight, whatever its type: llama.cpp's converter writes `W̃ / s` as floats, and TQ1_0 /
/// TQ2_0 blocks dequantize to `(t − 1) · d` with the tensor's `d` in every block.
pub fn from_values(values: &[f32], n: usize, k: usize) -> Result<TernaryMatrix, String> {
    if values.len() != n * k {
        return Err(format!("{} values do not fill a [{n}, {k}] weight", values.len()));
    }
    let mut magnitudes = Vec::with_capacity(n);
    for (row, v) in values.chunks_exact(k).enumerate() {
        let mut nonzero = v.iter().map(|x| x.abs()).filter(|&a| a != 0.0);
        let m = nonzero.next();
        if let Some(m) = m {
            if let Some(other) = nonzero.find(|&a| a != m) {
                return Err(format!("row {row} holds magnitudes {m} and {other}; a ternary weight has one a row"));
            }
            if !m.is_finite() {
                return Err(format!("row {row} holds {m}"));
            }
        }
        magnitudes.push(m);
    }
    let first = magnitudes.iter().flatten().copied().next().unwrap_or(1.0);
    let shared = magnitudes.iter().flatten().all(|&m| m == first);
    let (group, scales) = if shared {
        (n, vec![1.0 / first])
    } else {
        (1, magnitudes.iter().map(|m| 1.0 / m.unwrap_or(first)).collect())
    };
    let codes: Vec<i8> = values.iter().map(|&x| if x > 0.0 { 1 } else if x < 0.0 { -1 } else { 0 }).collect();
    let layout = TernaryLayout::new(n, k, group).map_err(|e| e.0)?;
    TernaryMatrix::from_codes(&codes, layout, scales).map_err(|e| e.0)
}

/// A packed ternary weight (`k` a multiple of 256) as TQ1_0/TQ2_0 blocks, each with its rows'
/// `d = 1 / s` (rounded to f16).
pub fn from_ternary(ty: GgmlType, m: &TernaryMatrix) -> Result<Vec<u8>, String> {
    let l = m.layout;
    if !l.k.is_multiple_of(QK_K) {
        return Err(format!("{ty} rows hold whole blocks of {QK_K} values; this weight has {}", l.k));
    }
    let codes: Vec<u8> = m.codes().iter().map(|&c| (c + 1) as u8).collect();
    let scales: Vec<f32> = (0..l.n).flat_map(|row| std::iter::repeat_n(1.0 / m.row_scale(row), l.k / QK_K)).collect();
    encode(ty, &codes, &scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 3) as u8
            })
            .collect()
    }

    #[test]
    fn both_types_round_trip_codes_and_scales() {
        let t = codes(3 * QK_K, 5);
        let d = [0.5, 1.25, 3.0e-3];
        for ty in [GgmlType::TQ1_0, GgmlType::TQ2_0] {
            let bytes = encode(ty, &t, &d).unwrap();
            assert_eq!(bytes.len(), 3 * ty.type_size());
            let (back, scales) = decode(ty, &bytes).unwrap();
            assert_eq!(back, t, "{ty}");
            assert_eq!(scales, d.map(|v| f16::from_f32(v).to_f32()), "{ty}");
        }
    }

    #[test]
    fn every_tq1_0_byte_value_decodes_as_ggml_does() {
        // All 3⁵ five-trit groups: pack as ggml's quantizer does, unpack trit by trit.
        for v in 0u16..243 {
            let byte = ((v * 256 + 242) / 243) as u8;
            let trits: Vec<u8> = (0..5).map(|n| tq1_0_trit(byte, n)).collect();
            let expect: Vec<u8> = (0..5).rev().map(|p| ((v / 3u16.pow(p)) % 3) as u8).collect();
            assert_eq!(trits, expect, "v = {v}");
        }
    }

    #[test]
    fn tq2_0_element_placement() {
        let mut t = vec![1u8; QK_K];
        t[130] = 2; // second half, sub-block 0, byte 32 + 2, bits 0-1
        t[97] = 0; // first half, sub-block 3, byte 1, bits 6-7
        let bytes = encode(GgmlType::TQ2_0, &t, &[1.0]).unwrap();
        assert_eq!(bytes[34] & 3, 2);
        assert_eq!(bytes[1] >> 6, 0);
        assert_eq!(bytes[0], 0b0101_0101);
    }

    #[test]
    fn ternary_matrices_round_trip_through_both_types() {
        let (n, k) = (3, 2 * QK_K);
        let c: Vec<i8> = codes(n * k, 9).iter().map(|&t| t as i8 - 1).collect();
        for (group, scales) in [(n, vec![4.0]), (1, vec![0.5, 2.0, 8.0])] {
            let m = TernaryMatrix::from_codes(&c, TernaryLayout::new(n, k, group).unwrap(), scales).unwrap();
            for ty in [GgmlType::TQ1_0, GgmlType::TQ2_0] {
                let values = crate::gguf::dequantize(ty, &from_ternary(ty, &m).unwrap()).unwrap();
                // Powers of two survive f16 exactly, so the scales come back too.
                assert_eq!(from_values(&values, n, k).unwrap(), m, "{ty} group {group}");
            }
        }
    }

    #[test]
    fn values_off_three_levels_are_refused() {
        let mut v = vec![0.5f32, -0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0];
        let m = from_values(&v, 2, 4).unwrap();
        // The zero row takes the other's scale: one scale for the tensor.
        assert_eq!((m.layout.group, m.row_scale(1)), (2, 2.0));
        assert_eq!(m.codes(), [1, -1, 0, 1, 0, 0, 0, 0]);
        v[4] = -0.25;
        let per_row = from_values(&v, 2, 4).unwrap();
        assert_eq!((per_row.layout.group, per_row.row_scale(0), per_row.row_scale(1)), (1, 2.0, 4.0));
        v[5] = 0.5;
        assert!(from_values(&v, 2, 4).unwrap_err().contains("row 1 holds magnitudes 0.25 and 0.5"));
        assert!(from_values(&[f32::INFINITY, 0.0], 1, 2).unwrap_err().contains("row 0 holds inf"));
        assert!(from_values(&v, 3, 4).is_err());
    }

    #[test]
    fn bad_blocks_are_refused() {
        let mut block = encode(GgmlType::TQ2_0, &[1; QK_K], &[1.0]).unwrap();
        block[0] = 0xff;
        assert!(decode(GgmlType::TQ2_0, &block).unwrap_err().contains("not ternary"));
        assert!(decode(GgmlType::TQ1_0, &[0; 53]).is_err());
        assert!(encode(GgmlType::Q8_0, &[1; QK_K], &[1.0]).is_err());
    }
}
