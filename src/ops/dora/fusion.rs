//! DoRA's rescaling as custom operations of Burn's fusion stream: one for the forward, one for the
//! backward (`du` and `dm` from one pass); and one for the factored weight norm.

use burn::tensor::{DType, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::DoraBackend;
use crate::ops::compute_dtype;
use crate::backend::fusion::{FusedOp, register};

/// The inputs in order `u, magnitude, norm, [bias], [dy]`, split back apart.
fn split<T>(inputs: Vec<T>, has_bias: bool) -> (T, T, T, Option<T>, Option<T>) {
    let mut it = inputs.into_iter();
    let (u, m, n) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let bias = if has_bias { it.next() } else { None };
    (u, m, n, bias, it.next())
}

#[derive(Clone, Debug)]
struct Forward {
    has_bias: bool,
}

impl<B: FusionBackend + DoraBackend> FusedOp<B> for Forward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let (u, m, n, bias, _) = split(inputs, self.has_bias);
        vec![B::dora_forward(u, m, n, bias)]
    }
}

#[derive(Clone, Debug)]
struct Backward {
    has_bias: bool,
}

impl<B: FusionBackend + DoraBackend> FusedOp<B> for Backward {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let (u, m, n, bias, dy) = split(inputs, self.has_bias);
        let (du, dm) = B::dora_backward(u, m, n, bias, dy.expect("the backward's inputs end with dy"));
        vec![du, dm]
    }
}

#[derive(Clone, Debug)]
struct Norm {
    scale: f64,
}

impl<B: FusionBackend + DoraBackend> FusedOp<B> for Norm {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let [w_sq, a_w, a, b]: [_; 4] = inputs.try_into().unwrap();
        vec![B::dora_norm(w_sq, a_w, a, b, self.scale)]
    }
}

impl<B: FusionBackend + DoraBackend> DoraBackend for Fusion<B> {
    fn dora_forward(u: FloatTensor<Self>, magnitude: FloatTensor<Self>, norm: FloatTensor<Self>, bias: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        let has_bias = bias.is_some();
        let outputs = vec![(u.shape.clone(), u.dtype)];
        let inputs = [u, magnitude, norm].into_iter().chain(bias).collect();
        register::<B, _>("kiln_dora_forward", inputs, outputs, Forward { has_bias }).remove(0)
    }

    fn dora_backward(
        u: FloatTensor<Self>,
        magnitude: FloatTensor<Self>,
        norm: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let has_bias = bias.is_some();
        let outputs = vec![(u.shape.clone(), u.dtype), (magnitude.shape.clone(), magnitude.dtype)];
        let inputs = [u, magnitude, norm].into_iter().chain(bias).chain([dy]).collect();
        let [du, dm]: [_; 2] = register::<B, _>("kiln_dora_backward", inputs, outputs, Backward { has_bias }).try_into().unwrap();
        (du, dm)
    }

    fn dora_norm(weight_norms_sq: FloatTensor<Self>, a_w: FloatTensor<Self>, a: FloatTensor<Self>, b: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        let outputs = vec![(weight_norms_sq.shape.clone(), DType::from(compute_dtype(a.dtype)))];
        let inputs = vec![weight_norms_sq, a_w, a, b];
        register::<B, _>("kiln_dora_norm", inputs, outputs, Norm { scale }).remove(0)
    }
}
