//! The decoder's linear layers are a type parameter, so a quantized or adapted linear (NF4,
//! BitNet, LoRA) replaces them without a change to the model: build or load the float model, then
//! [`Decoder::map_linears`](super::Decoder::map_linears) with a function from each layer's HF
//! name and float linear to the new layer (as PEFT's `target_modules` and bitsandbytes' module
//! replacement do), or pass that function to the loader to convert layer by layer while loading.

/// A linear layer the decoder's attention and MLP call (`[batch, seq, in] → [batch, seq, out]`):
/// every kiln [`LinearLayer`](kiln::nn::LinearLayer) (`Linear`, `Nf4Linear`, `LoraLinear` over
/// either).
pub use kiln::nn::LinearLayer as Projection;
