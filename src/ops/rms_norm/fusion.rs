//! RMSNorm as a custom operation of Burn's fusion stream.

use burn::tensor::{DType, Shape, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::{RmsNormBackend, RmsNormOutput};
use crate::backend::fusion::{FusedOp, register};

#[derive(Clone, Debug)]
struct Forward {
    epsilon: f64,
}

impl<B: FusionBackend + RmsNormBackend> FusedOp<B> for Forward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let mut inputs = inputs.into_iter();
        let (x, gamma) = (inputs.next().unwrap(), inputs.next().unwrap());
        let out = B::rms_norm_forward(x, gamma, inputs.next(), self.epsilon);
        [out.output, out.rstd].into_iter().chain(out.residual).collect()
    }
}

#[derive(Clone, Debug)]
struct Backward;

impl<B: FusionBackend + RmsNormBackend> FusedOp<B> for Backward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [h, gamma, rstd, dy]: [_; 4] = inputs.try_into().unwrap();
        let (dh, dgamma) = B::rms_norm_backward(h, gamma, rstd, dy);
        vec![dh, dgamma]
    }
}

impl<B: FusionBackend + RmsNormBackend> RmsNormBackend for Fusion<B> {
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> RmsNormOutput<Self> {
        let shape = x.shape.clone();
        let rows = shape.num_elements() / shape[shape.num_dims() - 1].max(1);
        let mut outputs = vec![(shape.clone(), x.dtype), (Shape::new([rows]), DType::F32)];
        if residual.is_some() {
            outputs.push((shape, x.dtype));
        }
        let inputs = [x, gamma].into_iter().chain(residual).collect();
        let mut out = register::<B, _>("kiln_rms_norm_forward", inputs, outputs, Forward { epsilon })
            .into_iter();
        RmsNormOutput {
            output: out.next().unwrap(),
            rstd: out.next().unwrap(),
            residual: out.next(),
        }
    }

    fn rms_norm_backward(
        h: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let outputs = vec![(h.shape.clone(), h.dtype), (gamma.shape.clone(), gamma.dtype)];
        let [dh, dgamma]: [_; 2] =
            register::<B, _>("kiln_rms_norm_backward", vec![h, gamma, rstd, dy], outputs, Backward)
                .try_into()
                .unwrap();
        (dh, dgamma)
    }
}
