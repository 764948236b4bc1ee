//! The decoder's linear layers are a type parameter, so a quantized or adapted linear (NF4,
//! BitNet, LoRA) replaces them without a change to the model: build or load the float model, then
//! [`Decoder::map_linears`](super::Decoder::map_linears) with a function from each layer's HF
//! name and float linear to the new layer (as PEFT's `target_modules` and bitsandbytes' module
//! replacement do), or pass that function to the loader to convert layer by layer while loading.

use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};
use kiln::nn::{Linear, Nf4Linear};
use kiln::ops::matmul::MatmulBackend;
use kiln::ops::nf4::Nf4Backend;

/// A linear layer the decoder's attention and MLP call: `[batch, seq, in] → [batch, seq, out]`.
pub trait Projection<B: Backend>: Module<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3>;
}

impl<B: MatmulBackend> Projection<B> for Linear<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        Linear::forward(self, x)
    }
}

impl<B: Nf4Backend> Projection<B> for Nf4Linear<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        Nf4Linear::forward(self, x)
    }
}
