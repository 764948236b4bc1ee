//! Instruction datasets in JSONL, one example a line, in either of the two common formats:
//! - alpaca: `{"instruction": …, "input": …, "output": …}` (`input` and `system` optional): the
//!   instruction (and input, after a blank line) becomes the user turn, `output` the answer;
//! - chat: `{"messages": [{"role": …, "content": …}, …]}` whose last message is the assistant's
//!   answer.
//!
//! Each example is rendered with the tokenizer's chat template; the tokens after the prompt
//! (the answer and the template's end-of-turn) are the ones the loss counts.

use std::io::BufRead;
use std::path::Path;

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use serde::Deserialize;

use crate::error::{LoadError, Result};
use crate::tokenizer::{Message, Tokenizer};
use crate::train::LmBatch;

/// One example: the conversation before the answer, and the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instruction {
    pub prompt: Vec<Message>,
    pub response: String,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Line {
    Chat { messages: Vec<Message> },
    Alpaca {
        instruction: String,
        #[serde(default)]
        input: String,
        output: String,
        #[serde(default)]
        system: Option<String>,
    },
}

impl Line {
    fn into_instruction(self) -> std::result::Result<Instruction, String> {
        match self {
            Line::Chat { mut messages } => {
                let answer = messages.pop().ok_or("`messages` is empty")?;
                if answer.role != "assistant" {
                    return Err(format!("the last message is the {}'s; it must be the assistant's answer", answer.role));
                }
                if messages.is_empty() {
                    return Err("`messages` has an answer but no prompt".into());
                }
                Ok(Instruction { prompt: messages, response: answer.content })
            }
            Line::Alpaca { instruction, input, output, system } => {
                let user = if input.trim().is_empty() { instruction } else { format!("{instruction}\n\n{input}") };
                let mut prompt: Vec<Message> = system.into_iter().map(|s| Message::new("system", s)).collect();
                prompt.push(Message::new("user", user));
                Ok(Instruction { prompt, response: output })
            }
        }
    }
}

/// Every example of a JSONL file (blank lines skipped); a bad line is an error naming the file
/// and the line.
pub fn read_jsonl(path: &Path) -> Result<Vec<Instruction>> {
    let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
    let mut examples = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| LoadError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let field = || format!("line {}", i + 1);
        let parsed: Line = serde_json::from_str(&line)
            .map_err(|e| LoadError::field(path, field(), format!("neither an alpaca nor a chat-messages example: {e}")))?;
        examples.push(parsed.into_instruction().map_err(|e| LoadError::field(path, field(), e))?);
    }
    Ok(examples)
}

/// An example's token ids and, per id, whether the loss predicts it (the answer's tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    pub ids: Vec<u32>,
    pub response: Vec<bool>,
}

impl Tokenized {
    /// `example` through the tokenizer's chat template, cut to `max_len` tokens. The prompt must
    /// render as a prefix of the whole conversation (true of the Llama 3 and Qwen templates).
    pub fn new(tokenizer: &Tokenizer, example: &Instruction, max_len: usize) -> Result<Self> {
        let prompt = tokenizer.encode_chat(&example.prompt, true)?;
        let mut conversation = example.prompt.clone();
        conversation.push(Message::new("assistant", example.response.clone()));
        let mut ids = tokenizer.encode_chat(&conversation, false)?;
        if !ids.starts_with(&prompt) || ids.len() == prompt.len() {
            let path = tokenizer.path();
            return Err(LoadError::field(path, "chat_template", "the prompt with the generation prompt is not a prefix of the conversation with its answer"));
        }
        let mut response: Vec<bool> = (0..ids.len()).map(|i| i >= prompt.len()).collect();
        ids.truncate(max_len);
        response.truncate(max_len);
        Ok(Self { ids, response })
    }
}

/// Pads examples to the longest in the batch (the padding is never predicted) and shifts them
/// into next-token inputs and targets, the mask counting the answer's tokens only.
#[derive(Debug, Clone)]
pub struct ResponseBatcher {
    pub pad: u32,
}

impl<B: Backend> Batcher<B, Tokenized, LmBatch<B>> for ResponseBatcher {
    fn batch(&self, items: Vec<Tokenized>, device: &B::Device) -> LmBatch<B> {
        let len = items.iter().map(|t| t.ids.len().saturating_sub(1)).max().unwrap_or(0).max(1);
        let (mut inputs, mut targets, mut mask) = (Vec::new(), Vec::new(), Vec::new());
        for item in &items {
            for p in 0..len {
                let (input, target) = (item.ids.get(p), item.ids.get(p + 1));
                inputs.push(*input.unwrap_or(&self.pad) as i64);
                targets.push(*target.unwrap_or(&self.pad) as i64);
                mask.push(if target.is_some() && item.response[p + 1] { 1.0f32 } else { 0.0 });
            }
        }
        let b = items.len();
        LmBatch {
            inputs: Tensor::<B, 2, Int>::from_data(TensorData::new(inputs, [b, len]), device),
            targets: Tensor::<B, 2, Int>::from_data(TensorData::new(targets, [b, len]), device),
            mask: Some(Tensor::<B, 2>::from_data(TensorData::new(mask, [b, len]), device)),
        }
    }
}
