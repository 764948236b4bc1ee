//! Chat templates: Jinja sources from HF tokenizer configs, rendered by minijinja with the
//! settings transformers uses (`trim_blocks`, `lstrip_blocks`, loop controls) and Python's string
//! methods (`.strip()`, `.startswith()`, …) through minijinja-contrib's pycompat layer.

use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

use crate::error::{LoadError, Result};

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    path: PathBuf,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("path", &self.path).finish()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `path` names its file in errors.
    pub fn new(source: String, path: &Path) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.map_err(|e| LoadError::field(path, "chat_template", e.to_string()))?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> std::result::Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_template_owned(NAME, source).map_err(|e| LoadError::field(path, "chat_template", e.to_string()))?;
        Ok(Self { env, path: path.to_path_buf() })
    }

    /// A `chat_template` field: a string, or a list of `{name, template}` (the one named
    /// `default` is used).
    pub(crate) fn from_config_value(value: &serde_json::Value, path: &Path) -> Result<Self> {
        let source = match value {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(items) => items
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .ok_or_else(|| LoadError::field(path, "chat_template", "a list of templates without one named `default`"))?
                .to_string(),
            other => return Err(LoadError::field(path, "chat_template", format!("expected a string, got {other}"))),
        };
        Self::new(source, path)
    }

    /// Renders a conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<String> {
        let template = self.env.get_template(NAME).map_err(|e| LoadError::field(&self.path, "chat_template", e.to_string()))?;
        template
            .render(context! {
                messages => Value::from(Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token.unwrap_or(""),
                eos_token => eos_token.unwrap_or(""),
            })
            .map_err(|e| LoadError::field(&self.path, "chat_template", format!("rendering failed: {e}")))
    }
}
