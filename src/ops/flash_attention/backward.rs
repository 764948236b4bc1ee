//! Flash attention under `Autodiff`: the node keeps q, k, v, the output and the log-sum-exp
//! (O(seq) beyond the inputs, no probabilities), and its backward runs the recomputing kernels.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{backend::AutodiffBackend, ops::FloatTensor};

use super::{AttentionOptions, AttentionOutput, FlashAttentionBackend};

#[derive(Debug)]
struct AttentionGrad;

/// What the backward needs from the forward.
#[derive(Debug, Clone)]
struct Saved<B: FlashAttentionBackend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    output: FloatTensor<B>,
    lse: FloatTensor<B>,
    options: AttentionOptions,
}

impl<B: FlashAttentionBackend> Backward<B, 3> for AttentionGrad {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let s = ops.state;
        let d_output = grads.consume::<B>(&ops.node);
        let (dq, dk, dv) = B::flash_attention_backward(s.q, s.k, s.v, s.bias, s.output, s.lse, d_output, s.options);
        for (node, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> FlashAttentionBackend for Autodiff<B, C> {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: AttentionOptions,
    ) -> AttentionOutput<Self> {
        let bias = bias.map(|b| b.primitive);
        let inner = B::flash_attention_forward(q.primitive.clone(), k.primitive.clone(), v.primitive.clone(), bias.clone(), options);
        let output = match AttentionGrad.prepare::<C>([q.node, k.node, v.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let saved = Saved { q: q.primitive, k: k.primitive, v: v.primitive, bias, output: inner.output.clone(), lse: inner.lse.clone(), options };
                prep.finish(saved, inner.output)
            }
            OpsKind::UnTracked(prep) => prep.finish(inner.output),
        };
        AttentionOutput { output, lse: <Self as AutodiffBackend>::from_inner(inner.lse) }
    }
}
