//! Dense products as custom operations of Burn's fusion stream.

use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use super::{GemmLayout, MatmulBackend, output_shape};
use crate::backend::fusion::{FusedOp, register};

/// The layout and which optional inputs follow `lhs, rhs` in the input list.
#[derive(Clone, Debug)]
struct Gemm {
    layout: GemmLayout,
    bias: bool,
    residual: bool,
}

impl<B: FusionBackend + MatmulBackend> FusedOp<B> for Gemm {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let mut inputs = inputs.into_iter();
        let (lhs, rhs) = (inputs.next().unwrap(), inputs.next().unwrap());
        let bias = self.bias.then(|| inputs.next().unwrap());
        let residual = self.residual.then(|| inputs.next().unwrap());
        vec![B::gemm(lhs, rhs, bias, residual, self.layout)]
    }
}

impl<B: FusionBackend + MatmulBackend> MatmulBackend for Fusion<B> {
    fn gemm(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        residual: Option<FloatTensor<Self>>,
        layout: GemmLayout,
    ) -> FloatTensor<Self> {
        let shape = output_shape(&lhs.shape, &rhs.shape, layout)
            .unwrap_or_else(|| panic!("kiln::matmul: operands {:?} and {:?} do not fit ({layout:?})", lhs.shape, rhs.shape));
        let op = Gemm { layout, bias: bias.is_some(), residual: residual.is_some() };
        let dtype = lhs.dtype;
        let inputs = [Some(lhs), Some(rhs), bias, residual].into_iter().flatten().collect();
        register::<B, _>("kiln_gemm", inputs, vec![(shape, dtype)], op).remove(0)
    }
}
