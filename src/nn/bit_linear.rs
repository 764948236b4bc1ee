use burn::config::Config;
use burn::module::{Initializer, Module, Param};
use burn::tensor::{DType, Tensor, backend::Backend};

use super::{LinearLayer, RmsNorm, RmsNormConfig, frozen, int_param};
use crate::ops::rms_norm::RmsNormBackend;
use crate::ops::ternary::{TernaryBackend, TernaryLayout, TernaryMatrix, TernaryParts, TernaryWeight, bitlinear, bitlinear_normed, ternary_matmul, ternary_matmul_normed};

/// Configuration of [`BitLinear`]. The defaults are BitNet b1.58's: no bias, one weight scale
/// per tensor, an RMSNorm on the input before its 8-bit quantization.
#[derive(Config, Debug)]
pub struct BitLinearConfig {
    pub d_input: usize,
    pub d_output: usize,
    #[config(default = false)]
    pub bias: bool,
    /// Output rows per weight scale; `None`: one scale for the whole weight.
    #[config(default = "None")]
    pub group: Option<usize>,
    /// Normalize the input (RMSNorm with a learned scale) before quantizing it, as BitNet's
    /// BitLinear does. Off where the model already normalizes there (HF's `BitNetForCausalLM`
    /// has its own sub-norms).
    #[config(default = true)]
    pub input_norm: bool,
    #[config(default = 1e-6)]
    pub norm_epsilon: f64,
    #[config(default = "Initializer::KaimingUniform{gain: 1.0 / 3f64.sqrt(), fan_out_only:false}")]
    pub initializer: Initializer,
}

impl BitLinearConfig {
    pub fn init<B: Backend>(&self, device: &B::Device) -> BitLinear<B> {
        let (i, o) = (self.d_input, self.d_output);
        BitLinear {
            weight: self.initializer.init_with([o, i], Some(i), Some(o), device),
            bias: self.bias.then(|| self.initializer.init_with([o], Some(i), Some(o), device)),
            norm: self.norm(device, None),
            group: self.group_rows(),
        }
    }

    fn group_rows(&self) -> usize {
        self.group.unwrap_or(self.d_output)
    }

    /// The input norm (γ = 1) in `dtype`, else the backend's default float dtype. kiln's RMSNorm
    /// takes x and γ in one dtype, so a layer taken over from a bf16 linear needs a bf16 γ (an f32
    /// one failed the first bf16 QAT step of a whole model, thirty-eighth session).
    fn norm<B: Backend>(&self, device: &B::Device, dtype: Option<DType>) -> Option<RmsNorm<B>> {
        self.input_norm.then(|| {
            let config = RmsNormConfig::new(self.d_input).with_epsilon(self.norm_epsilon);
            match dtype {
                Some(dtype) => config.init_with_dtype(device, dtype),
                None => config.init(device),
            }
        })
    }
}

/// A BitNet b1.58 linear layer for quantization-aware training: a latent float weight
/// `[d_output, d_input]` (HF's layout) quantized to ternary on every forward, the input
/// (optionally RMS-normalized) quantized to int8 per token, their product through
/// [`bitlinear`], whose gradients pass straight through both quantizers to the latent weight and
/// the input. [`BitLinear::to_ternary`] packs the trained layer for inference.
#[derive(Module, Debug)]
pub struct BitLinear<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    pub norm: Option<RmsNorm<B>>,
    /// Output rows per weight scale.
    pub group: usize,
}

impl<B: TernaryBackend + RmsNormBackend> BitLinear<B> {
    /// Take over a float [`super::Linear`]'s weight (transposed to `[d_output, d_input]`) and
    /// bias, with the rest from `config` (its sizes must match the layer's); the input norm's γ
    /// in the weight's dtype.
    pub fn from_linear(linear: &super::Linear<B>, config: &BitLinearConfig) -> Self {
        let [i, o] = linear.weight.shape().dims();
        assert!(config.d_input == i && config.d_output == o, "kiln::BitLinear::from_linear: config [{}, {}] for a linear [{i}, {o}]", config.d_input, config.d_output);
        let device = linear.weight.device();
        // A new leaf: the transposed weight (the float layer's parameter stays the float layer's).
        BitLinear {
            weight: Param::from_tensor(linear.weight.val().transpose().detach()),
            bias: linear.bias.clone(),
            norm: config.norm(&device, Some(linear.weight.dtype())),
            group: config.group_rows(),
        }
    }

    /// `quant(norm(x)) · quant(W)ᵀ + b` over the last axis; the output has the dtype of `x`
    /// (the latent weight is cast to it). The norm runs inside the activations' quantization
    /// ([`bitlinear_normed`]): its output is neither written nor saved for the backward.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let weight = self.weight.val().cast(x.dtype());
        let y = match &self.norm {
            Some(norm) => bitlinear_normed(x, norm.weight.val(), norm.epsilon, weight, self.group),
            None => bitlinear(x, weight, self.group),
        };
        add_bias(y, &self.bias)
    }

    /// The packed inference layer: the weight quantized once, bias and norm kept.
    pub fn to_ternary(&self) -> TernaryLinear<B> {
        let weight = TernaryWeight::quantize(self.weight.val(), self.group);
        TernaryLinear::from_weight(weight, self.bias.as_ref().map(|b| b.val()), self.norm.clone())
    }
}

/// A frozen BitNet linear layer on a packed ternary weight (2 bits a weight, f32 group scales):
/// `y = W2A8(norm(x)) + b` through [`ternary_matmul`]. Every part is a parameter that takes no
/// gradient, so it saves and loads as a Burn record and holds no optimizer state.
#[derive(Module, Debug)]
pub struct TernaryLinear<B: Backend> {
    /// Packed codes, sixteen a u32 word (the backend's ints).
    pub words: Param<Tensor<B, 1, burn::tensor::Int>>,
    /// One f32 scale per group of output rows.
    pub scales: Param<Tensor<B, 1>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    pub norm: Option<RmsNorm<B>>,
    #[module(skip)]
    pub layout: TernaryLayout,
}

impl<B: Backend> TernaryLinear<B> {
    /// A layer from a device weight, an optional bias `[n]` and an optional input norm.
    pub fn from_weight(weight: TernaryWeight<B>, bias: Option<Tensor<B, 1>>, norm: Option<RmsNorm<B>>) -> Self {
        let TernaryParts { words, scales, layout } = weight;
        Self { words: int_param(words), scales: frozen(scales), bias: bias.map(frozen), norm, layout }
    }

    /// A layer from a host weight (e.g. read by [`TernaryMatrix::from_hf`]).
    pub fn from_host(weight: &TernaryMatrix, bias: Option<Tensor<B, 1>>, device: &B::Device) -> Self {
        Self::from_weight(TernaryWeight::from_host(weight, device), bias, None)
    }

    /// The packed weight.
    pub fn weight(&self) -> TernaryWeight<B> {
        TernaryParts { words: self.words.val(), scales: self.scales.val(), layout: self.layout }
    }

    /// Device bytes of the packed weight and its scales.
    pub fn weight_bytes(&self) -> usize {
        self.layout.bytes()
    }
}

impl<B: TernaryBackend + RmsNormBackend> TernaryLinear<B> {
    /// `W2A8(norm(x)) + b` over the last axis (any float dtype; the output has it too), the norm
    /// inside the activations' quantization ([`ternary_matmul_normed`]).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let y = match &self.norm {
            Some(norm) => ternary_matmul_normed(x, norm.weight.val(), norm.epsilon, &self.weight()),
            None => ternary_matmul(x, &self.weight()),
        };
        add_bias(y, &self.bias)
    }
}

fn add_bias<B: Backend, const D: usize>(y: Tensor<B, D>, bias: &Option<Param<Tensor<B, 1>>>) -> Tensor<B, D> {
    match bias {
        Some(b) => {
            let dtype = y.dtype();
            y + b.val().cast(dtype).unsqueeze()
        }
        None => y,
    }
}

/// As a projection the layers report the weight their forward applies; an input norm is part of
/// the forward but not of that weight.
impl<B: TernaryBackend + RmsNormBackend> LinearLayer<B> for BitLinear<B> {
    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        BitLinear::forward(self, x)
    }

    fn d_input(&self) -> usize {
        self.weight.shape().dims::<2>()[1]
    }

    fn d_output(&self) -> usize {
        self.weight.shape().dims::<2>()[0]
    }

    fn bias(&self) -> Option<Tensor<B, 1>> {
        self.bias.as_ref().map(|b| b.val())
    }

    fn dense_weight(&self, dtype: DType) -> Tensor<B, 2> {
        TernaryWeight::quantize(self.weight.val(), self.group).dequantize(dtype).transpose()
    }
}

impl<B: TernaryBackend + RmsNormBackend> LinearLayer<B> for TernaryLinear<B> {
    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        TernaryLinear::forward(self, x)
    }

    fn d_input(&self) -> usize {
        self.layout.k
    }

    fn d_output(&self) -> usize {
        self.layout.n
    }

    fn bias(&self) -> Option<Tensor<B, 1>> {
        self.bias.as_ref().map(|b| b.val())
    }

    fn dense_weight(&self, dtype: DType) -> Tensor<B, 2> {
        self.weight().dequantize(dtype).transpose()
    }
}
