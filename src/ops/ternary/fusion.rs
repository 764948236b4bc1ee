//! Ternary weights as custom operations of Burn's fusion stream. A weight travels as two
//! operands: its words (int), then its scales (float).

use burn::tensor::{DType, Shape, TensorMetadata, ops::{FloatTensor, IntTensor}};
use burn_fusion::{Fusion, FusionBackend};

use super::{RowNorm, TernaryBackend, TernaryLayout, TernaryParts, TernaryPrimitive};
use crate::backend::fusion::{FusedMixedOp, Operand, register_mixed};

type Mixed<B> = Operand<FloatTensor<B>, IntTensor<B>>;

/// The op family named in the panics of a wrong operand.
const OP: &str = "ternary";

#[derive(Clone, Debug)]
enum Op {
    Quantize { group: usize },
    Dequantize { layout: TernaryLayout, dtype: DType },
    QuantizeActs,
    Matmul { layout: TernaryLayout },
    MatmulNormed { layout: TernaryLayout, epsilon: f64 },
    InputGrad { layout: TernaryLayout },
    /// With `normed` the inputs end in the norm's `γ` and `rstd`.
    WeightGrad { normed: bool },
}

fn weight<B: FusionBackend>(inputs: &mut impl Iterator<Item = Mixed<B>>, layout: TernaryLayout) -> TernaryPrimitive<B> {
    let words = match inputs.next() {
        Some(Operand::Int(t)) => t,
        _ => unreachable!("ternary fusion op: the weight's words expected"),
    };
    TernaryParts { words, scales: Operand::float(inputs.next(), OP), layout }
}

impl<B: FusionBackend + TernaryBackend> FusedMixedOp<B> for Op {
    fn run(&self, inputs: Vec<Mixed<B>>) -> Vec<Mixed<B>> {
        let mut inputs = inputs.into_iter();
        match *self {
            Op::Quantize { group } => {
                let w = B::ternary_quantize(Operand::float(inputs.next(), OP), group);
                vec![Operand::Int(w.words), Operand::Float(w.scales)]
            }
            Op::Dequantize { layout, dtype } => vec![Operand::Float(B::ternary_dequantize(weight::<B>(&mut inputs, layout), dtype))],
            Op::QuantizeActs => {
                let (codes, scales) = B::ternary_quantize_acts(Operand::float(inputs.next(), OP));
                vec![Operand::Float(codes), Operand::Float(scales)]
            }
            Op::Matmul { layout } => {
                let x = Operand::float(inputs.next(), OP);
                vec![Operand::Float(B::ternary_matmul(x, weight::<B>(&mut inputs, layout)))]
            }
            Op::MatmulNormed { layout, epsilon } => {
                let (x, gamma) = (Operand::float(inputs.next(), OP), Operand::float(inputs.next(), OP));
                let (y, rstd) = B::ternary_matmul_normed(x, gamma, epsilon, weight::<B>(&mut inputs, layout));
                vec![Operand::Float(y), Operand::Float(rstd)]
            }
            Op::InputGrad { layout } => {
                let dy = Operand::float(inputs.next(), OP);
                vec![Operand::Float(B::ternary_input_grad(dy, weight::<B>(&mut inputs, layout)))]
            }
            Op::WeightGrad { normed } => {
                let (dy, x) = (Operand::float(inputs.next(), OP), Operand::float(inputs.next(), OP));
                let norm = normed.then(|| RowNorm { gamma: Operand::float(inputs.next(), OP), rstd: Operand::float(inputs.next(), OP) });
                vec![Operand::Float(B::ternary_weight_grad(dy, x, norm))]
            }
        }
    }
}

type FusionWeight<B> = TernaryPrimitive<Fusion<B>>;

/// Register `op` with `lead` (an activation or gradient) and the weight's two tensors as inputs.
fn with_weight<B: FusionBackend + TernaryBackend>(name: &'static str, lead: FloatTensor<Fusion<B>>, weight: FusionWeight<B>, output: (Shape, DType), op: Op) -> FloatTensor<Fusion<B>> {
    register_mixed::<B, _>(name, vec![lead, weight.words, weight.scales], vec![output], op).remove(0)
}

impl<B: FusionBackend + TernaryBackend> TernaryBackend for Fusion<B> {
    fn ternary_quantize(weight: FloatTensor<Self>, group: usize) -> FusionWeight<B> {
        let shape = weight.shape();
        let layout = TernaryLayout::new(shape[0], shape[1], group).unwrap_or_else(|e| panic!("{e}"));
        let outputs = vec![(Shape::new([layout.words()]), DType::I32), (Shape::new([layout.groups()]), DType::F32)];
        let [words, scales]: [_; 2] = register_mixed::<B, _>("kiln_ternary_quantize", vec![weight], outputs, Op::Quantize { group }).try_into().unwrap();
        TernaryParts { words, scales, layout }
    }

    fn ternary_dequantize(weight: FusionWeight<B>, dtype: DType) -> FloatTensor<Self> {
        let layout = weight.layout;
        let outputs = vec![(Shape::new([layout.n, layout.k]), dtype)];
        register_mixed::<B, _>("kiln_ternary_dequantize", vec![weight.words, weight.scales], outputs, Op::Dequantize { layout, dtype }).remove(0)
    }

    fn ternary_quantize_acts(x: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = x.shape();
        let outputs = vec![(shape.clone(), x.dtype), (Shape::new([shape[0]]), DType::F32)];
        let [codes, scales]: [_; 2] = register_mixed::<B, _>("kiln_ternary_quantize_acts", vec![x], outputs, Op::QuantizeActs).try_into().unwrap();
        (codes, scales)
    }

    fn ternary_matmul(x: FloatTensor<Self>, weight: FusionWeight<B>) -> FloatTensor<Self> {
        let layout = weight.layout;
        let output = (Shape::new([x.shape()[0], layout.n]), x.dtype);
        with_weight::<B>("kiln_ternary_matmul", x, weight, output, Op::Matmul { layout })
    }

    fn ternary_matmul_normed(x: FloatTensor<Self>, gamma: FloatTensor<Self>, epsilon: f64, weight: FusionWeight<B>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let layout = weight.layout;
        let m = x.shape()[0];
        let outputs = vec![(Shape::new([m, layout.n]), x.dtype), (Shape::new([m]), DType::F32)];
        let inputs = vec![x, gamma, weight.words, weight.scales];
        let [y, rstd]: [_; 2] = register_mixed::<B, _>("kiln_ternary_matmul_normed", inputs, outputs, Op::MatmulNormed { layout, epsilon }).try_into().unwrap();
        (y, rstd)
    }

    fn ternary_input_grad(dy: FloatTensor<Self>, weight: FusionWeight<B>) -> FloatTensor<Self> {
        let layout = weight.layout;
        let output = (Shape::new([dy.shape()[0], layout.k]), dy.dtype);
        with_weight::<B>("kiln_ternary_input_grad", dy, weight, output, Op::InputGrad { layout })
    }

    fn ternary_weight_grad(dy: FloatTensor<Self>, x: FloatTensor<Self>, norm: Option<RowNorm<FloatTensor<Self>>>) -> FloatTensor<Self> {
        let outputs = vec![(Shape::new([dy.shape()[1], x.shape()[1]]), dy.dtype)];
        let normed = norm.is_some();
        let mut inputs = vec![dy, x];
        inputs.extend(norm.into_iter().flat_map(|n| [n.gamma, n.rstd]));
        register_mixed::<B, _>("kiln_ternary_weight_grad", inputs, outputs, Op::WeightGrad { normed }).remove(0)
    }
}
