//! Dense products as custom operations of Burn's fusion stream.

use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use super::{GemmViews, MatmulBackend};
use crate::backend::fusion::{FusedOp, register};

/// The views and which optional inputs follow `lhs, rhs` in the input list. The operands enter
/// the fusion stream as they are (any rank): the views are taken inside the op, where reshapes
/// are free, instead of as reshape operations of their own.
#[derive(Clone, Debug)]
struct Gemm {
    views: GemmViews,
    bias: bool,
    residual: bool,
}

impl<B: FusionBackend + MatmulBackend> FusedOp<B> for Gemm {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let mut inputs = inputs.into_iter();
        let (lhs, rhs) = (inputs.next().unwrap(), inputs.next().unwrap());
        let bias = self.bias.then(|| inputs.next().unwrap());
        let residual = self.residual.then(|| inputs.next().unwrap());
        vec![B::gemm(lhs, rhs, bias, residual, self.views.clone())]
    }
}

impl<B: FusionBackend + MatmulBackend> MatmulBackend for Fusion<B> {
    fn gemm(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        residual: Option<FloatTensor<Self>>,
        views: GemmViews,
    ) -> FloatTensor<Self> {
        // Views that do not fit fail here, on the caller's thread, not inside the stream.
        views.product();
        let output = (views.out.clone(), lhs.dtype);
        let op = Gemm { views, bias: bias.is_some(), residual: residual.is_some() };
        let inputs = [Some(lhs), Some(rhs), bias, residual].into_iter().flatten().collect();
        register::<B, _>("kiln_gemm", inputs, vec![output], op).remove(0)
    }
}
