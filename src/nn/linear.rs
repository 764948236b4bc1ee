use burn::config::Config;
use burn::module::{Initializer, Module, ModuleDisplay, Param};
use burn::tensor::{DType, FloatDType, Tensor, backend::Backend};

use crate::ops::matmul::{MatmulBackend, linear, linear_residual};
use crate::ops::nf4::Quantized4;

/// Configuration of [`Linear`]; the same fields and defaults as `burn::nn::LinearConfig`.
#[derive(Config, Debug)]
pub struct LinearConfig {
    pub d_input: usize,
    pub d_output: usize,
    #[config(default = true)]
    pub bias: bool,
    #[config(default = "Initializer::KaimingUniform{gain: 1.0 / 3f64.sqrt(), fan_out_only:false}")]
    pub initializer: Initializer,
}

impl LinearConfig {
    pub fn init<B: Backend>(&self, device: &B::Device) -> Linear<B> {
        let (i, o) = (self.d_input, self.d_output);
        Linear {
            weight: self.initializer.init_with([i, o], Some(i), Some(o), device),
            bias: self.bias.then(|| self.initializer.init_with([o], Some(i), Some(o), device)),
        }
    }
}

/// A drop-in for `burn::nn::Linear` (same parameters, same record, weight `[d_input, d_output]`)
/// whose products run through [`crate::ops::matmul`]: cuBLASLt on CUDA, the bias (and, with
/// [`Linear::forward_residual`], a residual) added in the product's epilogue.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: MatmulBackend> Linear<B> {
    /// `x · W + b` over the last axis.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        linear(x, self.weight.val(), self.bias.as_ref().map(|b| b.val()))
    }

    /// `x · W + b + residual`, the residual added in the same kernel.
    pub fn forward_residual<const D: usize>(&self, x: Tensor<B, D>, residual: Tensor<B, D>) -> Tensor<B, D> {
        linear_residual(x, self.weight.val(), self.bias.as_ref().map(|b| b.val()), residual)
    }
}

impl<B: Backend> From<burn::nn::Linear<B>> for Linear<B> {
    /// Take over a Burn `Linear` (its parameters, ids included, so optimizer state carries over).
    fn from(l: burn::nn::Linear<B>) -> Self {
        Self { weight: l.weight, bias: l.bias }
    }
}

/// A linear layer as the layers built around it see one: a forward over the last axis and its
/// widths. Implemented by [`Linear`], [`crate::nn::Nf4Linear`] and [`crate::nn::LoraLinear`], so
/// an adapter wraps any of them and a model takes any of them as its projections.
pub trait LinearLayer<B: Backend>: Module<B> + ModuleDisplay {
    /// `[.., d_input] → [.., d_output]`.
    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D>;
    fn d_input(&self) -> usize;
    fn d_output(&self) -> usize;
    /// The bias `[d_output]`, if the layer adds one.
    fn bias(&self) -> Option<Tensor<B, 1>>;
    /// The weight the forward applies, as a float `[d_input, d_output]` tensor in `dtype`
    /// (dequantized, or with an adapter's update in it): for merging and DoRA's norms, not for
    /// the forward.
    fn dense_weight(&self, dtype: DType) -> Tensor<B, 2>;
    /// The `[d_input, d_output]` weight the forward multiplies, where it is a float tensor as
    /// stored (no copy): an adapter around such a layer runs the base's product and its update
    /// as one operation ([`crate::ops::lora::lora_linear`]). `None` for quantized or adapted
    /// layers.
    fn float_weight(&self) -> Option<Tensor<B, 2>> {
        None
    }

    /// The frozen 4-bit `[d_output, d_input]` weight the forward multiplies, where it is one: an
    /// adapter around such a layer runs as one operation too
    /// ([`crate::ops::lora::lora_linear_4bit`]). `None` for float or adapted layers.
    fn packed_weight(&self) -> Option<Quantized4<B>> {
        None
    }
}

impl<B: MatmulBackend> LinearLayer<B> for Linear<B> {
    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        Linear::forward(self, x)
    }

    fn d_input(&self) -> usize {
        self.weight.shape()[0]
    }

    fn d_output(&self) -> usize {
        self.weight.shape()[1]
    }

    fn bias(&self) -> Option<Tensor<B, 1>> {
        self.bias.as_ref().map(|b| b.val())
    }

    fn dense_weight(&self, dtype: DType) -> Tensor<B, 2> {
        self.weight.val().cast(FloatDType::from(dtype))
    }

    fn float_weight(&self) -> Option<Tensor<B, 2>> {
        Some(self.weight.val())
    }
}
