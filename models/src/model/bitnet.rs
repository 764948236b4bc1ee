//! BitNet b1.58 decoders: any family's config with ternary linears. [`to_bitnet`] patches a float
//! decoder for quantization-aware training ([`BitLinear`]: latent weights, straight-through
//! gradients); [`pack_ternary`] turns the trained decoder into packed 2-bit [`TernaryLinear`]s
//! whose products run the W2A8 kernels. The embedding, norms and head stay float, as in BitNet.

use kiln::nn::{BitLinear, BitLinearConfig, Linear, TernaryLinear};
use kiln::ops::{rms_norm::RmsNormBackend, ternary::TernaryBackend};

use super::{Decoder, FloatDecoder};

/// A decoder whose attention and MLP linears train as BitNet b1.58 layers.
pub type BitNetDecoder<B> = Decoder<B, BitLinear<B>>;
/// A decoder whose attention and MLP linears are packed ternary weights.
pub type TernaryDecoder<B> = Decoder<B, TernaryLinear<B>>;

/// How the linears are quantized: BitNet's defaults are one scale per weight and an RMSNorm on
/// each linear's input before its 8-bit quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitNetOptions {
    /// Output rows per weight scale; `None`: one per weight.
    pub group: Option<usize>,
    pub input_norm: bool,
}

impl Default for BitNetOptions {
    fn default() -> Self {
        Self { group: None, input_norm: true }
    }
}

/// Every attention and MLP linear of `model` as a [`BitLinear`] whose latent weight starts from
/// the float weight (training from scratch or continuing from a float checkpoint).
pub fn to_bitnet<B: TernaryBackend + RmsNormBackend>(model: FloatDecoder<B>, options: BitNetOptions) -> BitNetDecoder<B> {
    model.map_linears(|_, linear: Linear<B>| {
        let [d_input, d_output] = linear.weight.shape().dims();
        let config = BitLinearConfig::new(d_input, d_output)
            .with_bias(linear.bias.is_some())
            .with_group(options.group)
            .with_input_norm(options.input_norm);
        BitLinear::from_linear(&linear, &config)
    })
}

/// The trained decoder with its linears packed (quantized once; what the QAT forward computed).
pub fn pack_ternary<B: TernaryBackend + RmsNormBackend>(model: &BitNetDecoder<B>) -> TernaryDecoder<B> {
    model.clone().map_linears(|_, layer| layer.to_ternary())
}
