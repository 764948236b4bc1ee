//! LoRA as custom operations of Burn's fusion stream: the forward (both products) and the
//! backward (four products, two dropouts) are one recorded operation each.

use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use super::{DropoutMask, LoraBackend, LoraGrads, LoraSpec};
use crate::backend::fusion::{FusedOp, register};

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
}
