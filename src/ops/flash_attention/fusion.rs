//! Flash attention as custom operations of Burn's fusion stream.

use burn::tensor::{DType, Shape, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::{AttentionOptions, AttentionOutput, FlashAttentionBackend};
use crate::backend::fusion::{FusedOp, register};

#[derive(Clone, Debug)]
struct Forward(AttentionOptions);

impl<B: FusionBackend + FlashAttentionBackend> FusedOp<B> for Forward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let mut inputs = inputs.into_iter();
        let [q, k, v] = [(); 3].map(|_| inputs.next().unwrap());
        let out = B::flash_attention_forward(q, k, v, inputs.next(), self.0);
        vec![out.output, out.lse]
    }
}

#[derive(Clone, Debug)]
struct Backward(AttentionOptions);

impl<B: FusionBackend + FlashAttentionBackend> FusedOp<B> for Backward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let mut inputs = inputs.into_iter();
        let [q, k, v, output, lse, d_output] = [(); 6].map(|_| inputs.next().unwrap());
        let (dq, dk, dv) = B::flash_attention_backward(q, k, v, inputs.next(), output, lse, d_output, self.0);
        vec![dq, dk, dv]
    }
}

impl<B: FusionBackend + FlashAttentionBackend> FlashAttentionBackend for Fusion<B> {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: AttentionOptions,
    ) -> AttentionOutput<Self> {
        let dims = q.shape.clone();
        let outputs = vec![(dims.clone(), q.dtype), (Shape::new([dims[0], dims[1], dims[2]]), DType::F32)];
        let inputs = [q, k, v].into_iter().chain(bias).collect();
        let [output, lse]: [_; 2] =
            register::<B, _>("kiln_flash_attention_forward", inputs, outputs, Forward(options)).try_into().unwrap();
        AttentionOutput { output, lse }
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_output: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let outputs = [&q, &k, &v].map(|t| (t.shape.clone(), t.dtype)).to_vec();
        let inputs = [q, k, v, output, lse, d_output].into_iter().chain(bias).collect();
        let [dq, dk, dv]: [_; 3] =
            register::<B, _>("kiln_flash_attention_backward", inputs, outputs, Backward(options)).try_into().unwrap();
        (dq, dk, dv)
    }
}
