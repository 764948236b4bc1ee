//! Text ↔ token ids through the `tokenizers` crate (HF `tokenizer.json`), chat templates from
//! `tokenizer_config.json` (or `chat_template.jinja`) rendered with minijinja the way
//! transformers renders them, and incremental decoding for streaming.

mod template;

use std::path::{Path, PathBuf};

pub use template::{ChatTemplate, Message};

use crate::error::{LoadError, Result};

/// A tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    bos_token: Option<String>,
    eos_token: Option<String>,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("path", &self.path).field("vocab", &self.vocab_size()).finish()
    }
}

impl Tokenizer {
    /// Reads `tokenizer.json` from a model directory, with `tokenizer_config.json`'s special
    /// tokens and chat template (or `chat_template.jinja`) when present.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let mut tokenizer = Self::from_file(&dir.join("tokenizer.json"))?;
        let config_path = dir.join("tokenizer_config.json");
        if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path).map_err(|e| LoadError::io(&config_path, e))?;
            let config: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| LoadError::malformed(&config_path, format!("not JSON: {e}")))?;
            tokenizer.bos_token = special_token(&config, "bos_token", &config_path)?;
            tokenizer.eos_token = special_token(&config, "eos_token", &config_path)?;
            if let Some(source) = config.get("chat_template").filter(|t| !t.is_null()) {
                tokenizer.chat_template = Some(ChatTemplate::from_config_value(source, &config_path)?);
            }
        }
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|e| LoadError::io(&jinja, e))?;
            tokenizer.chat_template = Some(ChatTemplate::new(source, &jinja)?);
        }
        Ok(tokenizer)
    }

    /// Reads a `tokenizer.json` alone (no chat template or named special tokens).
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| LoadError::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| LoadError::malformed(path, e.to_string()))?;
        Ok(Self::from_tokenizer(inner, path))
    }

    /// The vocabulary a GGUF file embeds (SentencePiece or GPT-2 BPE kinds), with its BOS/EOS
    /// tokens and `tokenizer.chat_template` when present.
    pub fn from_gguf(file: &crate::gguf::GgufFile) -> Result<Self> {
        let inner = file.tokenizer()?;
        let token = |key: &str| -> Result<Option<String>> {
            Ok(file.opt_u64(key)?.and_then(|id| u32::try_from(id).ok()).and_then(|id| inner.id_to_token(id)))
        };
        let (bos, eos) = (token("tokenizer.ggml.bos_token_id")?, token("tokenizer.ggml.eos_token_id")?);
        let template = file.opt_str("tokenizer.chat_template")?.map(|t| ChatTemplate::new(t.to_string(), file.path())).transpose()?;
        let mut tokenizer = Self::from_tokenizer(inner, file.path()).with_special_tokens(bos, eos);
        tokenizer.chat_template = template;
        Ok(tokenizer)
    }

    /// Wraps a built `tokenizers::Tokenizer` (e.g. one made from a GGUF vocabulary); `path` names
    /// its origin in errors.
    pub fn from_tokenizer(inner: tokenizers::Tokenizer, path: &Path) -> Self {
        Self { inner, path: path.to_path_buf(), bos_token: None, eos_token: None, chat_template: None }
    }

    /// Sets the BOS/EOS token strings the chat template sees.
    pub fn with_special_tokens(mut self, bos: Option<String>, eos: Option<String>) -> Self {
        self.bos_token = bos;
        self.eos_token = eos;
        self
    }

    pub fn with_chat_template(mut self, template: ChatTemplate) -> Self {
        self.chat_template = Some(template);
        self
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self.inner.encode(text, add_special_tokens).map_err(|e| LoadError::malformed(&self.path, format!("encoding failed: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| LoadError::malformed(&self.path, format!("decoding failed: {e}")))
    }

    /// The id of a token string (special tokens included).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The file the tokenizer was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The id of the end-of-sequence token named in `tokenizer_config.json`, if any.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The prompt text of a conversation, as transformers' `apply_chat_template(tokenize=False)`.
    pub fn apply_chat_template(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self.chat_template.as_ref().ok_or_else(|| LoadError::field(&self.path, "chat_template", "this tokenizer has no chat template"))?;
        template.render(messages, add_generation_prompt, self.bos_token.as_deref(), self.eos_token.as_deref())
    }

    /// The chat template's prompt as token ids. Templates write the BOS themselves, so the
    /// post-processor's special tokens are not added again.
    pub fn encode_chat(&self, messages: &[Message], add_generation_prompt: bool) -> Result<Vec<u32>> {
        self.encode(&self.apply_chat_template(messages, add_generation_prompt)?, false)
    }
}

/// A special token in `tokenizer_config.json`: a string or an `AddedToken` object.
fn special_token(config: &serde_json::Value, field: &str, path: &Path) -> Result<Option<String>> {
    match config.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => v
            .get("content")
            .and_then(|c| c.as_str())
            .map(|c| Some(c.to_string()))
            .ok_or_else(|| LoadError::field(path, field, format!("expected a string or {{\"content\": ...}}, got {v}"))),
    }
}

/// Turns a growing list of generated ids into text pieces as soon as they decode to whole
/// characters (a byte-level token may end inside a UTF-8 sequence).
#[derive(Debug, Clone, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Text already emitted.
    emitted: usize,
}

impl TextStream {
    /// Adds a token and returns the new text it completes, if any.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tokenizer.decode(&self.ids, true)?;
        if text.ends_with('\u{FFFD}') || text.len() < self.emitted || !text.is_char_boundary(self.emitted) {
            return Ok(String::new());
        }
        let new = text[self.emitted..].to_string();
        self.emitted = text.len();
        Ok(new)
    }

    /// All text so far.
    pub fn text(&self, tokenizer: &Tokenizer) -> Result<String> {
        tokenizer.decode(&self.ids, true)
    }
}
