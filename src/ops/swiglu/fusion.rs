//! Gated linear units as custom operations of Burn's fusion stream.

use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use super::{GluActivation, SwiGluBackend};
use crate::backend::fusion::{FusedOp, register};

#[derive(Clone, Debug)]
struct Forward(GluActivation);

impl<B: FusionBackend + SwiGluBackend> FusedOp<B> for Forward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [gate, up]: [_; 2] = inputs.try_into().unwrap();
        vec![B::glu_forward(gate, up, self.0)]
    }
}

#[derive(Clone, Debug)]
struct Backward(GluActivation);

impl<B: FusionBackend + SwiGluBackend> FusedOp<B> for Backward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [gate, up, dy]: [_; 3] = inputs.try_into().unwrap();
        let (d_gate, d_up) = B::glu_backward(gate, up, dy, self.0);
        vec![d_gate, d_up]
    }
}

impl<B: FusionBackend + SwiGluBackend> SwiGluBackend for Fusion<B> {
    fn glu_forward(gate: FloatTensor<Self>, up: FloatTensor<Self>, act: GluActivation) -> FloatTensor<Self> {
        let outputs = vec![(gate.shape.clone(), gate.dtype)];
        register::<B, _>("kiln_glu_forward", vec![gate, up], outputs, Forward(act)).remove(0)
    }

    fn glu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        act: GluActivation,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let out = (gate.shape.clone(), gate.dtype);
        let [d_gate, d_up]: [_; 2] =
            register::<B, _>("kiln_glu_backward", vec![gate, up, dy], vec![out.clone(), out], Backward(act))
                .try_into()
                .unwrap();
        (d_gate, d_up)
    }
}
