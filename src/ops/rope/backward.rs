//! RoPE under `Autodiff`: a rotation is orthogonal, so its backward is the inverse rotation of
//! the incoming gradient (the same kernel with the sine negated). The tables are constants.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::ops::FloatTensor;

use super::RopeBackend;

#[derive(Debug)]
struct RopeGrad;

impl<B: RopeBackend> Backward<B, 1> for RopeGrad {
    /// `(cos, sin, offset, inverse)` of the forward.
    type State = (FloatTensor<B>, FloatTensor<B>, usize, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (cos, sin, offset, inverse) = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        if let [Some(node)] = ops.parents {
            grads.register::<B>(node.id, B::rope_forward(dy, cos, sin, offset, !inverse));
        }
    }
}

impl<B: RopeBackend, C: CheckpointStrategy> RopeBackend for Autodiff<B, C> {
    fn rope_forward(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
        inverse: bool,
    ) -> FloatTensor<Self> {
        let out = B::rope_forward(x.primitive.clone(), cos.primitive.clone(), sin.primitive.clone(), offset, inverse);
        match RopeGrad.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((cos.primitive, sin.primitive, offset, inverse), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}
