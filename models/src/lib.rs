//! Llama, Qwen, Mistral and BitNet decoders built on kiln's fused ops: HF `config.json` and safetensors
//! loading, the `tokenizers` tokenizer with chat templates, and generation with on-device sampling.
//!
//! - [`config`]: [`DecoderConfig`], read from HF configs ([`config::from_hf_json`]).
//! - [`model`]: [`Decoder`], generic over its linear layers so quantized or adapted linears replace
//!   them without changes to the model ([`Decoder::map_linears`], [`load_with`]).
//! - [`loader`]: parameter sources (safetensors, random init).
//! - [`gguf`]: GGUF v2/v3 files: metadata, dequantization, embedded vocabularies.
//! - [`tokenizer`]: [`Tokenizer`] with chat templates and streaming decode.
//! - [`generation`]: [`Decoder::generate`], samplers on the device.
//! - [`runtime`]: picks CUDA, wgpu or the CPU at run time.
//! - [`adapter`]: LoRA adapters on the decoder's linears by name, and PEFT's adapter files.
//! - [`data`]: instruction datasets (JSONL, alpaca and chat formats) tokenized for response-only loss.
//! - [`train`]: `TrainStep` for [`Decoder`] (Burn's `Learner`) and a compact progress renderer.

pub mod adapter;
pub mod config;
pub mod data;
pub mod error;
pub mod generation;
pub mod gguf;
pub mod loader;
pub mod model;
pub mod runtime;
pub mod tokenizer;
pub mod train;

pub use config::{DecoderConfig, Family};
pub use error::{LoadError, Result};
pub use model::build::{LinearShape, LoadOptions, MakeLinear, MapFloat, build_with, load, load_made, load_with};
pub use model::bitnet::{BitNetDecoder, BitNetOptions, TernaryDecoder, TernaryMaker, load_bitnet, pack_ternary, to_bitnet};
pub use model::nf4::{Nf4Decoder, Nf4Maker, Nf4Options, load_nf4};
pub use generation::{GenerationConfig, SamplingConfig};
pub use model::{Decoder, DecoderCache, FloatDecoder, Projection};
pub use tokenizer::{Message, Tokenizer};
