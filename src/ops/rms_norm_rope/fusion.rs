//! The fused QK-norm + RoPE as custom operations of Burn's fusion stream.

use burn::tensor::{DType, Shape, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::{RmsNormRopeBackend, RmsNormRopeOutput};
use crate::backend::fusion::{FusedOp, register};

#[derive(Clone, Debug)]
struct Forward {
    offset: usize,
    epsilon: f64,
}

impl<B: FusionBackend + RmsNormRopeBackend> FusedOp<B> for Forward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [q, k, qg, kg, cos, sin]: [_; 6] = inputs.try_into().unwrap();
        let out = B::rms_norm_rope_forward(q, k, qg, kg, cos, sin, self.offset, self.epsilon);
        vec![out.q, out.k, out.q_rstd, out.k_rstd]
    }
}

#[derive(Clone, Debug)]
struct Backward {
    offset: usize,
}

impl<B: FusionBackend + RmsNormRopeBackend> FusedOp<B> for Backward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [x, gamma, rstd, dy, cos, sin]: [_; 6] = inputs.try_into().unwrap();
        let (dx, dgamma) = B::rms_norm_rope_backward(x, gamma, rstd, dy, cos, sin, self.offset);
        vec![dx, dgamma]
    }
}

fn heads(shape: &Shape) -> Shape {
    Shape::new([shape[0] * shape[1] * shape[2]])
}

impl<B: FusionBackend + RmsNormRopeBackend> RmsNormRopeBackend for Fusion<B> {
    fn rms_norm_rope_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        q_gamma: FloatTensor<Self>,
        k_gamma: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
        epsilon: f64,
    ) -> RmsNormRopeOutput<Self> {
        let outputs = vec![
            (q.shape.clone(), q.dtype),
            (k.shape.clone(), k.dtype),
            (heads(&q.shape), DType::F32),
            (heads(&k.shape), DType::F32),
        ];
        let inputs = vec![q, k, q_gamma, k_gamma, cos, sin];
        let [q, k, q_rstd, k_rstd]: [_; 4] =
            register::<B, _>("kiln_rms_norm_rope_forward", inputs, outputs, Forward { offset, epsilon })
                .try_into()
                .unwrap();
        RmsNormRopeOutput { q, k, q_rstd, k_rstd }
    }

    fn rms_norm_rope_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let outputs = vec![(x.shape.clone(), x.dtype), (gamma.shape.clone(), gamma.dtype)];
        let inputs = vec![x, gamma, rstd, dy, cos, sin];
        let [dx, dgamma]: [_; 2] = register::<B, _>("kiln_rms_norm_rope_backward", inputs, outputs, Backward { offset })
            .try_into()
            .unwrap();
        (dx, dgamma)
    }
}
