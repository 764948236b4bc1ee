//! 4-bit weights as custom operations of Burn's fusion stream. A weight's parts travel as the
//! op's operands (int words and codes, float scales), in the order [`operands`] lists them.

use burn::tensor::{DType, Shape, TensorMetadata, ops::{FloatTensor, IntTensor}};
use burn_fusion::{Fusion, FusionBackend};

use super::{Layout4, Nf4Backend, Parts4, QuantType, Quantized4Primitive, Scales};
use crate::backend::fusion::{FusedMixedOp, Operand, register_mixed};

pub(crate) type Mixed<B> = Operand<FloatTensor<B>, IntTensor<B>>;

/// The op family named in the panics of a wrong operand.
const OP: &str = "nf4";

#[derive(Clone, Debug)]
enum Op {
    Quantize { kind: QuantType, block: usize },
    Dequantize { layout: Layout4, nested: bool, dtype: DType },
    Matmul { layout: Layout4, nested: bool },
    InputGrad { layout: Layout4, nested: bool },
}

/// The weight's tensors: words, code book, then the scales.
pub(crate) fn operands<T>(weight: Parts4<T, T>) -> Vec<T> {
    let mut out = vec![weight.words, weight.code];
    match weight.scales {
        Scales::Absmax(a) => out.push(a),
        Scales::Nested { codes, code, absmax, offset } => out.extend([codes, code, absmax, offset]),
    }
    out
}

/// The inverse of [`operands`] on the inner backend (struct fields evaluate in source order).
pub(crate) fn assemble<B: FusionBackend>(inputs: &mut impl Iterator<Item = Mixed<B>>, layout: Layout4, nested: bool) -> Quantized4Primitive<B> {
    let words = Operand::int(inputs.next(), OP);
    let code = Operand::float(inputs.next(), OP);
    let scales = if nested {
        Scales::Nested { codes: Operand::int(inputs.next(), OP), code: Operand::float(inputs.next(), OP), absmax: Operand::float(inputs.next(), OP), offset: Operand::float(inputs.next(), OP) }
    } else {
        Scales::Absmax(Operand::float(inputs.next(), OP))
    };
    Parts4 { words, code, scales, layout }
}

impl<B: FusionBackend + Nf4Backend> FusedMixedOp<B> for Op {
    fn run(&self, inputs: Vec<Mixed<B>>) -> Vec<Mixed<B>> {
        let mut inputs = inputs.into_iter();
        match *self {
            Op::Quantize { kind, block } => {
                let w = B::quantize_4bit(Operand::float(inputs.next(), OP), kind, block);
                let Scales::Absmax(absmax) = w.scales else { unreachable!("quantize returns plain absmax") };
                vec![Operand::Int(w.words), Operand::Float(w.code), Operand::Float(absmax)]
            }
            Op::Dequantize { layout, nested, dtype } => vec![Operand::Float(B::dequantize_4bit(assemble::<B>(&mut inputs, layout, nested), dtype))],
            Op::Matmul { layout, nested } => {
                let x = Operand::float(inputs.next(), OP);
                vec![Operand::Float(B::matmul_4bit(x, assemble::<B>(&mut inputs, layout, nested)))]
            }
            Op::InputGrad { layout, nested } => {
                let dy = Operand::float(inputs.next(), OP);
                vec![Operand::Float(B::matmul_4bit_input_grad(dy, assemble::<B>(&mut inputs, layout, nested)))]
            }
        }
    }
}

type FusionWeight<B> = Quantized4Primitive<Fusion<B>>;

impl<B: FusionBackend + Nf4Backend> Nf4Backend for Fusion<B> {
    fn quantize_4bit(weight: FloatTensor<Self>, kind: QuantType, block: usize) -> FusionWeight<B> {
        let shape = weight.shape();
        let layout = Layout4 { n: shape[0], k: shape[1], kind, block };
        let outputs = vec![(Shape::new([layout.words()]), DType::I32), (Shape::new([16]), DType::F32), (Shape::new([layout.blocks()]), DType::F32)];
        let [words, code, absmax]: [_; 3] =
            register_mixed::<B, _>("kiln_nf4_quantize", vec![weight], outputs, Op::Quantize { kind, block }).try_into().unwrap();
        Parts4 { words, code, scales: Scales::Absmax(absmax), layout }
    }

    fn dequantize_4bit(weight: FusionWeight<B>, dtype: DType) -> FloatTensor<Self> {
        let (layout, nested) = (weight.layout, weight.nested());
        let outputs = vec![(Shape::new([layout.n, layout.k]), dtype)];
        register_mixed::<B, _>("kiln_nf4_dequantize", operands(weight), outputs, Op::Dequantize { layout, nested, dtype }).remove(0)
    }

    fn matmul_4bit(x: FloatTensor<Self>, weight: FusionWeight<B>) -> FloatTensor<Self> {
        let (layout, nested) = (weight.layout, weight.nested());
        let outputs = vec![(Shape::new([x.shape()[0], layout.n]), x.dtype)];
        let mut inputs = vec![x];
        inputs.extend(operands(weight));
        register_mixed::<B, _>("kiln_nf4_matmul", inputs, outputs, Op::Matmul { layout, nested }).remove(0)
    }

    fn matmul_4bit_input_grad(dy: FloatTensor<Self>, weight: FusionWeight<B>) -> FloatTensor<Self> {
        let (layout, nested) = (weight.layout, weight.nested());
        let outputs = vec![(Shape::new([dy.shape()[0], layout.k]), dy.dtype)];
        let mut inputs = vec![dy];
        inputs.extend(operands(weight));
        register_mixed::<B, _>("kiln_nf4_input_grad", inputs, outputs, Op::InputGrad { layout, nested }).remove(0)
    }
}
