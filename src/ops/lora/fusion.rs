//! LoRA as custom operations of Burn's fusion stream: the forward (both products) and the
//! backward (four products, two dropouts) are one recorded operation each, and so are a LoRA
//! layer's forward and backward over a float or a 4-bit base ([`LoraBackend::lora_linear_forward`],
//! [`LoraBackend::lora_linear_4bit_forward`]).

use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use super::{DropoutMask, LoraBackend, LoraGrads, LoraLinearGrads, LoraSpec};
use crate::backend::fusion::{FusedMixedOp, FusedOp, Operand, register, register_mixed};
use crate::ops::nf4::{self, Layout4, Quantized4Primitive, fusion::Mixed};

#[derive(Clone, Debug)]
struct Dropout(DropoutMask);

impl<B: FusionBackend + LoraBackend> FusedOp<B> for Dropout {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [x]: [_; 1] = inputs.try_into().unwrap();
        vec![B::lora_dropout(x, self.0)]
    }
}

#[derive(Clone, Debug)]
struct Forward(LoraSpec);

impl<B: FusionBackend + LoraBackend> FusedOp<B> for Forward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [x, base, a, b]: [_; 4] = inputs.try_into().unwrap();
        let (y, h) = B::lora_forward(x, base, a, b, self.0);
        vec![y, h]
    }
}

/// The inputs are `x, h, a, b, dy`, then the prior gradient of `x` where there is one.
#[derive(Clone, Debug)]
struct Backward(LoraSpec);

impl<B: FusionBackend + LoraBackend> FusedOp<B> for Backward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let mut inputs = inputs.into_iter();
        let [x, h, a, b, dy] = [(); 5].map(|_| inputs.next().expect("the backward's five inputs"));
        let g = B::lora_backward(x, h, a, b, dy, self.0, inputs.next());
        vec![g.x, g.a, g.b]
    }
}

/// The inputs are `x, w, a, b`, then the bias where there is one.
#[derive(Clone, Debug)]
struct LinearForward(LoraSpec);

impl<B: FusionBackend + LoraBackend> FusedOp<B> for LinearForward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let mut inputs = inputs.into_iter();
        let [x, w, a, b] = [(); 4].map(|_| inputs.next().expect("the forward's four inputs"));
        let (y, hs) = B::lora_linear_forward(x, w, inputs.next(), a, b, self.0);
        vec![y, hs]
    }
}

/// The inputs are `x, hs, w, a, b, dy`, then the prior gradient of `x` where there is one; the
/// outputs `dA, dB`, then `dx` where it is asked for.
#[derive(Clone, Debug)]
struct LinearBackward {
    spec: LoraSpec,
    want_dx: bool,
}

impl<B: FusionBackend + LoraBackend> FusedOp<B> for LinearBackward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let mut inputs = inputs.into_iter();
        let [x, hs, w, a, b, dy] = [(); 6].map(|_| inputs.next().expect("the backward's six inputs"));
        let g = B::lora_linear_backward(x, hs, w, a, b, dy, self.spec, inputs.next(), self.want_dx);
        [g.a, g.b].into_iter().chain(g.x).collect()
    }
}

/// The inputs are `x, a, b`, the bias where there is one, then the 4-bit weight's parts
/// ([`nf4::fusion::operands`]).
#[derive(Clone, Debug)]
struct Linear4bitForward {
    spec: LoraSpec,
    layout: Layout4,
    nested: bool,
    bias: bool,
}

impl<B: FusionBackend + LoraBackend> FusedMixedOp<B> for Linear4bitForward {
    fn run(&self, inputs: Vec<Mixed<B>>) -> Vec<Mixed<B>> {
        const OP: &str = "lora_linear_4bit";
        let mut inputs = inputs.into_iter();
        let [x, a, b] = [(); 3].map(|_| Operand::float(inputs.next(), OP));
        let bias = self.bias.then(|| Operand::float(inputs.next(), OP));
        let w = nf4::fusion::assemble::<B>(&mut inputs, self.layout, self.nested);
        let (y, hs) = B::lora_linear_4bit_forward(x, w, bias, a, b, self.spec);
        vec![Operand::Float(y), Operand::Float(hs)]
    }
}

/// The inputs are `x, hs, a, b, dy`, the prior gradient of `x` where there is one, then the
/// 4-bit weight's parts; the outputs `dA, dB`, then `dx` where it is asked for.
#[derive(Clone, Debug)]
struct Linear4bitBackward {
    spec: LoraSpec,
    layout: Layout4,
    nested: bool,
    prior: bool,
    want_dx: bool,
}

impl<B: FusionBackend + LoraBackend> FusedMixedOp<B> for Linear4bitBackward {
    fn run(&self, inputs: Vec<Mixed<B>>) -> Vec<Mixed<B>> {
        const OP: &str = "lora_linear_4bit backward";
        let mut inputs = inputs.into_iter();
        let [x, hs, a, b, dy] = [(); 5].map(|_| Operand::float(inputs.next(), OP));
        let prior = self.prior.then(|| Operand::float(inputs.next(), OP));
        let w = nf4::fusion::assemble::<B>(&mut inputs, self.layout, self.nested);
        let g = B::lora_linear_4bit_backward(x, hs, w, a, b, dy, self.spec, prior, self.want_dx);
        [g.a, g.b].into_iter().chain(g.x).map(Operand::Float).collect()
    }
}

impl<B: FusionBackend + LoraBackend> LoraBackend for Fusion<B> {
    fn lora_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        let out = (x.shape.clone(), x.dtype);
        register::<B, _>("kiln_lora_dropout", vec![x], vec![out], Dropout(mask)).remove(0)
    }

    fn lora_forward(
        x: FloatTensor<Self>,
        base: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let rows = x.shape.num_elements() / a.shape[1].max(1);
        let outputs = vec![(base.shape.clone(), base.dtype), ([rows, a.shape[0]].into(), x.dtype)];
        let [y, h]: [_; 2] = register::<B, _>("kiln_lora_forward", vec![x, base, a, b], outputs, Forward(spec)).try_into().unwrap();
        (y, h)
    }

    fn lora_backward(
        x: FloatTensor<Self>,
        h: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: LoraSpec,
        prior: Option<FloatTensor<Self>>,
    ) -> LoraGrads<FloatTensor<Self>> {
        let outputs = vec![(x.shape.clone(), x.dtype), (a.shape.clone(), a.dtype), (b.shape.clone(), b.dtype)];
        let inputs = [x, h, a, b, dy].into_iter().chain(prior).collect();
        let [x, a, b]: [_; 3] = register::<B, _>("kiln_lora_backward", inputs, outputs, Backward(spec)).try_into().unwrap();
        LoraGrads { x, a, b }
    }

    fn lora_linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let rows = x.shape.num_elements() / a.shape[1].max(1);
        let out = super::products::with_last(x.shape.clone(), w.shape[1]);
        let outputs = vec![(out, x.dtype), ([rows, a.shape[0]].into(), x.dtype)];
        let inputs = [x, w, a, b].into_iter().chain(bias).collect();
        let [y, hs]: [_; 2] = register::<B, _>("kiln_lora_linear_forward", inputs, outputs, LinearForward(spec)).try_into().unwrap();
        (y, hs)
    }

    fn lora_linear_4bit_forward(
        x: FloatTensor<Self>,
        w: Quantized4Primitive<Self>,
        bias: Option<FloatTensor<Self>>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        spec: LoraSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (layout, nested) = (w.layout, w.nested());
        let rows = x.shape.num_elements() / layout.k.max(1);
        let outputs = vec![(super::products::with_last(x.shape.clone(), layout.n), x.dtype), ([rows, a.shape[0]].into(), x.dtype)];
        let op = Linear4bitForward { spec, layout, nested, bias: bias.is_some() };
        let inputs = [x, a, b].into_iter().chain(bias).chain(nf4::fusion::operands(w)).collect();
        let [y, hs]: [_; 2] = register_mixed::<B, _>("kiln_lora_linear_4bit_forward", inputs, outputs, op).try_into().unwrap();
        (y, hs)
    }

    fn lora_linear_4bit_backward(
        x: FloatTensor<Self>,
        hs: FloatTensor<Self>,
        w: Quantized4Primitive<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: LoraSpec,
        prior: Option<FloatTensor<Self>>,
        want_dx: bool,
    ) -> LoraLinearGrads<FloatTensor<Self>> {
        let (layout, nested) = (w.layout, w.nested());
        let mut outputs = vec![(a.shape.clone(), a.dtype), (b.shape.clone(), b.dtype)];
        if want_dx {
            outputs.push((x.shape.clone(), x.dtype));
        }
        let op = Linear4bitBackward { spec, layout, nested, prior: prior.is_some(), want_dx };
        let inputs = [x, hs, a, b, dy].into_iter().chain(prior).chain(nf4::fusion::operands(w)).collect();
        let mut grads = register_mixed::<B, _>("kiln_lora_linear_4bit_backward", inputs, outputs, op).into_iter();
        let [a, b] = [(); 2].map(|_| grads.next().expect("dA and dB"));
        LoraLinearGrads { x: grads.next(), a, b }
    }

    fn lora_linear_backward(
        x: FloatTensor<Self>,
        hs: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: LoraSpec,
        prior: Option<FloatTensor<Self>>,
        want_dx: bool,
    ) -> LoraLinearGrads<FloatTensor<Self>> {
        let mut outputs = vec![(a.shape.clone(), a.dtype), (b.shape.clone(), b.dtype)];
        if want_dx {
            outputs.push((x.shape.clone(), x.dtype));
        }
        let inputs = [x, hs, w, a, b, dy].into_iter().chain(prior).collect();
        let mut grads = register::<B, _>("kiln_lora_linear_backward", inputs, outputs, LinearBackward { spec, want_dx }).into_iter();
        let [a, b] = [(); 2].map(|_| grads.next().expect("dA and dB"));
        LoraLinearGrads { x: grads.next(), a, b }
    }
}
