//! RoPE as a custom operation of Burn's fusion stream.

use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use super::RopeBackend;
use crate::backend::fusion::{FusedOp, register};

#[derive(Clone, Debug)]
struct Rotate {
    offset: usize,
    inverse: bool,
}

impl<B: FusionBackend + RopeBackend> FusedOp<B> for Rotate {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [x, cos, sin]: [_; 3] = inputs.try_into().unwrap();
        vec![B::rope_forward(x, cos, sin, self.offset, self.inverse)]
    }
}

impl<B: FusionBackend + RopeBackend> RopeBackend for Fusion<B> {
    fn rope_forward(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
        inverse: bool,
    ) -> FloatTensor<Self> {
        let outputs = vec![(x.shape.clone(), x.dtype)];
        register::<B, _>("kiln_rope", vec![x, cos, sin], outputs, Rotate { offset, inverse })
            .remove(0)
    }
}
