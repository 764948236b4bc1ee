//! 4-bit weights from plain Burn ops: the nibbles unpacked with integer shifts, the codes looked
//! up, each block scaled; products dequantize first. Quantization runs the host definition
//! ([`super::format`]), which is the bit-exact oracle of the kernels.

use burn::tensor::{DType, ElementConversion, Int, Tensor, backend::Backend, ops::FloatTensor};

use super::{Packed4, QuantType, Quantized4, Quantized4Primitive, Scales};
use crate::ops::{compute_dtype, prim, wrap};

/// Bit offsets of the eight codes of a word, in element order (first element in the high nibble
/// of the low byte).
const NIBBLE_SHIFTS: [i64; 8] = [4, 0, 12, 8, 20, 16, 28, 24];
/// Bit offsets of the four 8-bit absmax codes of a word.
const BYTE_SHIFTS: [i64; 4] = [0, 8, 16, 24];

/// [`super::Nf4Backend::quantize_4bit`]: read the weight back, quantize on the host, upload.
pub fn quantize<B: Backend>(weight: FloatTensor<B>, kind: QuantType, block: usize) -> Quantized4Primitive<B> {
    let weight: Tensor<B, 2> = wrap(weight);
    let (dims, device) = (weight.dims(), weight.device());
    let values = weight.into_data().convert::<f32>().into_vec::<f32>().expect("f32 weight");
    let packed = Packed4::quantize(&values, &dims, kind, block, false).unwrap_or_else(|e| panic!("{e}"));
    Quantized4::<B>::from_host(&packed, &device).expect("a 2-D weight").primitive()
}

/// [`super::Nf4Backend::dequantize_4bit`]: `code[q] · scale` per element, in f32 (f64 for f64).
pub fn dequantize<B: Backend>(weight: Quantized4Primitive<B>, dtype: DType) -> FloatTensor<B> {
    let weight: Quantized4<B> = weight.map(Tensor::from_primitive, wrap);
    let l = weight.layout;
    let compute = compute_dtype(dtype);
    let codes = unpack(weight.words, &NIBBLE_SHIFTS, 15);
    let values = weight.code.cast(compute).select(0, codes);
    let scales = block_scales::<B>(weight.scales, compute, l.blocks());
    let per_value = scales.reshape([l.blocks(), 1]).expand([l.blocks(), l.block]).reshape([l.blocks() * l.block]);
    let w = values.slice(0..l.len()) * per_value.slice(0..l.len());
    prim(w.reshape([l.n, l.k]).cast(dtype))
}

/// [`super::Nf4Backend::matmul_4bit`]: `x · dequantize(W)ᵀ`.
pub fn matmul<B: Backend>(x: FloatTensor<B>, weight: Quantized4Primitive<B>) -> FloatTensor<B> {
    let x: Tensor<B, 2> = wrap(x);
    let dtype = x.dtype();
    let w: Tensor<B, 2> = wrap(dequantize::<B>(weight, compute_dtype(dtype).into()));
    prim(x.cast(w.dtype()).matmul(w.transpose()).cast(dtype))
}

/// [`super::Nf4Backend::matmul_4bit_input_grad`]: `dy · dequantize(W)`.
pub fn input_grad<B: Backend>(dy: FloatTensor<B>, weight: Quantized4Primitive<B>) -> FloatTensor<B> {
    let dy: Tensor<B, 2> = wrap(dy);
    let dtype = dy.dtype();
    let w: Tensor<B, 2> = wrap(dequantize::<B>(weight, compute_dtype(dtype).into()));
    prim(dy.cast(w.dtype()).matmul(w).cast(dtype))
}

/// The `(word >> shift) & mask` fields of every word, word by word.
pub(crate) fn unpack<B: Backend>(words: Tensor<B, 1, Int>, shifts: &[i64], mask: i64) -> Tensor<B, 1, Int> {
    let (count, fields) = (words.dims()[0], shifts.len());
    let shifts = Tensor::<B, 1, Int>::from_ints(shifts, &words.device()).reshape([1, fields]).expand([count, fields]);
    words.reshape([count, 1]).expand([count, fields]).bitwise_right_shift(shifts).bitwise_and_scalar(mask.elem()).reshape([count * fields])
}

/// The absmax of each of `blocks` blocks, dequantized when nested (code × scale, then + offset).
fn block_scales<B: Backend>(scales: Scales<Tensor<B, 1, Int>, Tensor<B, 1>>, compute: burn::tensor::FloatDType, blocks: usize) -> Tensor<B, 1> {
    match scales {
        Scales::Absmax(a) => a.cast(compute),
        Scales::Nested { codes, code, absmax, offset } => {
            let q = unpack(codes, &BYTE_SHIFTS, 255).slice(0..blocks);
            let groups = absmax.dims()[0];
            let group = super::NESTED_BLOCK;
            let per_block = absmax.cast(compute).reshape([groups, 1]).expand([groups, group]).reshape([groups * group]).slice(0..blocks);
            code.cast(compute).select(0, q) * per_block + offset.cast(compute)
        }
    }
}
