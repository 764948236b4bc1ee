//! Fine-tuning data: instruction datasets in JSONL ([`instruct`]), tokenized with the model's chat
//! template so that the loss falls on the response tokens only.

pub mod instruct;

pub use instruct::{Instruction, ResponseBatcher, Tokenized, read_jsonl};
