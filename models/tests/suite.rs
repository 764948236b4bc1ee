//! Every kiln-models integration test in one binary (see kiln's `tests/suite.rs` for why); each
//! concern's tests stay in their own file. Run one file's tests with a filter:
//! `cargo test -p kiln-models --test suite hf_parity::`.

#[path = "../../tests/common/mod.rs"]
mod common;
mod support;
mod bitnet_checkpoint;
mod bitnet_qat;
mod gguf_parity;
mod gguf_robustness;
mod hf_parity;
mod instruct_data;
mod loader_errors;
mod lora_adapter;
mod nf4_checkpoint;
mod sampler;
mod tokenizer;
