use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{DType, Int, Tensor, backend::Backend};

use super::{frozen, int_param};
use crate::nn::{Linear, LinearLayer};
use crate::ops::nf4::{FormatError, Layout4, Nf4Backend, Packed4, Parts4, QuantType, Quantized4, Scales, matmul_4bit};

/// Configuration of [`Nf4Linear`]; the defaults are QLoRA's (NF4, block 64, double quantization).
#[derive(Config, Debug)]
pub struct Nf4LinearConfig {
    pub d_input: usize,
    pub d_output: usize,
    #[config(default = true)]
    pub bias: bool,
    #[config(default = "QuantType::Nf4")]
    pub kind: QuantType,
    #[config(default = 64)]
    pub block: usize,
    #[config(default = true)]
    pub double_quant: bool,
}

impl Nf4LinearConfig {
    /// A layer of the configured shape whose codes are all zero, for loading a record into
    /// (Burn's pattern: `config.init(device).load_record(record)`).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Nf4Linear<B> {
        let layout = Layout4 { n: self.d_output, k: self.d_input, kind: self.kind, block: self.block };
        let n = layout.len();
        let absmax = if self.double_quant {
            let blocks = layout.blocks();
            crate::ops::nf4::Absmax::Nested { codes: vec![0; blocks], absmax: vec![0.0; blocks.div_ceil(crate::ops::nf4::NESTED_BLOCK)], offset: 0.0 }
        } else {
            crate::ops::nf4::Absmax::Plain(vec![0.0; layout.blocks()])
        };
        let packed = Packed4::from_parts(self.kind, self.block, &[layout.n, layout.k], vec![0; n / 2], absmax).unwrap_or_else(|e| panic!("{e}"));
        let bias = self.bias.then(|| Tensor::zeros([self.d_output], device));
        Nf4Linear::from_host(&packed, bias, device).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// A frozen linear layer with a 4-bit weight (bitsandbytes' NF4/FP4 layout): `y = x · Wᵀ + b`
/// through [`matmul_4bit`]. The weight's parts are parameters that take no gradient, so a model
/// holding it trains (e.g. LoRA adapters around it) without gradients or optimizer state for the
/// base; the bias is frozen too. Saves and loads as a Burn record.
#[derive(Module, Debug)]
pub struct Nf4Linear<B: Backend> {
    /// Packed codes, eight a u32 word (stored as the backend's ints).
    pub words: Param<Tensor<B, 1, Int>>,
    /// The 16-value code book.
    pub code: Param<Tensor<B, 1>>,
    /// f32 absmax per block, or with double quantization one f32 scale per 256 blocks.
    pub absmax: Param<Tensor<B, 1>>,
    /// Double quantization: the blocks' 8-bit codes (four a word), the dynamic code book and the
    /// offset (`[1]`).
    pub nested: Option<NestedScales<B>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub layout: Layout4,
}

/// The double-quantized part of an [`Nf4Linear`]'s scales.
#[derive(Module, Debug)]
pub struct NestedScales<B: Backend> {
    pub codes: Param<Tensor<B, 1, Int>>,
    pub code: Param<Tensor<B, 1>>,
    pub offset: Param<Tensor<B, 1>>,
}

/// The memory an [`Nf4Linear`] holds, next to the bf16 layer it replaces.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Nf4Memory {
    /// Bytes of codes, scales and code books.
    pub weight_bytes: usize,
    /// Bits per weight value, scales and code books included.
    pub bits_per_weight: f64,
    /// Bytes of the same weight in bf16.
    pub bf16_bytes: usize,
}

impl std::fmt::Display for Nf4Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes ({:.3} bits a weight; bf16 {} bytes, {:.2}x smaller)",
            self.weight_bytes,
            self.bits_per_weight,
            self.bf16_bytes,
            self.bf16_bytes as f64 / self.weight_bytes as f64
        )
    }
}

impl<B: Backend> Nf4Linear<B> {
    /// A layer from a device weight and an optional bias `[n]`.
    pub fn from_quantized(weight: Quantized4<B>, bias: Option<Tensor<B, 1>>) -> Self {
        let Parts4 { words, code, scales, layout } = weight;
        let (absmax, nested) = match scales {
            Scales::Absmax(a) => (a, None),
            Scales::Nested { codes, code, absmax, offset } => {
                (absmax, Some(NestedScales { codes: int_param(codes), code: frozen(code), offset: frozen(offset) }))
            }
        };
        Self { words: int_param(words), code: frozen(code), absmax: frozen(absmax), nested, bias: bias.map(frozen), layout }
    }

    /// A layer from a host weight `[n, k]` (e.g. read by [`crate::ops::nf4::bnb::from_bnb`]).
    pub fn from_host(weight: &Packed4, bias: Option<Tensor<B, 1>>, device: &B::Device) -> Result<Self, FormatError> {
        Ok(Self::from_quantized(Quantized4::from_host(weight, device)?, bias))
    }

    /// Quantize a float [`Linear`] (weight `[d_input, d_output]`), keeping its bias.
    pub fn from_linear(linear: &Linear<B>, kind: QuantType, block: usize, double_quant: bool) -> Self
    where
        B: Nf4Backend,
    {
        let weight = linear.weight.val().transpose();
        Self::from_quantized(Quantized4::quantize(weight, kind, block, double_quant), linear.bias.as_ref().map(|b| b.val()))
    }

    /// The 4-bit weight.
    pub fn weight(&self) -> Quantized4<B> {
        let scales = match &self.nested {
            None => Scales::Absmax(self.absmax.val()),
            Some(n) => Scales::Nested { codes: n.codes.val(), code: n.code.val(), absmax: self.absmax.val(), offset: n.offset.val() },
        };
        Parts4 { words: self.words.val(), code: self.code.val(), scales, layout: self.layout }
    }

    /// `x · Wᵀ + b` over the last axis of `x` (any float dtype; the output has it too).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D>
    where
        B: Nf4Backend,
    {
        let y = matmul_4bit(x, &self.weight());
        match &self.bias {
            Some(b) => {
                let dtype = y.dtype();
                y + b.val().cast(dtype).unsqueeze()
            }
            None => y,
        }
    }

    /// The float weight `[d_input, d_output]` (Burn's `Linear` layout) in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Tensor<B, 2>
    where
        B: Nf4Backend,
    {
        self.weight().dequantize(dtype).transpose()
    }

    /// What the layer's weight occupies.
    pub fn memory(&self) -> Nf4Memory {
        let w = self.weight();
        Nf4Memory { weight_bytes: w.bytes(), bits_per_weight: w.bits_per_value(), bf16_bytes: 2 * w.layout.len() }
    }
}

impl<B: Nf4Backend> LinearLayer<B> for Nf4Linear<B> {
    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        Nf4Linear::forward(self, x)
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
        self.dequantize(dtype)
    }

    fn packed_weight(&self) -> Option<Quantized4<B>> {
        Some(self.weight())
    }
}
