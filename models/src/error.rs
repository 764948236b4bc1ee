//! Errors of everything that reads files: each names the file and, where there is one, the tensor
//! or field at fault. Nothing that parses a file panics on its content.

use std::path::{Path, PathBuf};

/// A failure to read a model, tokenizer or template file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The file's bytes do not follow its format (truncated, bad header, bad offsets).
    #[error("{path}: malformed file: {message}")]
    Malformed { path: PathBuf, message: String },
    /// A config field is missing, of the wrong type or out of range.
    #[error("{path}: field `{field}`: {message}")]
    Field { path: PathBuf, field: String, message: String },
    /// A tensor is missing, or its shape or dtype is not what the config asks for.
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor { path: PathBuf, tensor: String, message: String },
}

impl LoadError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io { path: path.to_path_buf(), source }
    }

    pub(crate) fn malformed(path: &Path, message: impl Into<String>) -> Self {
        Self::Malformed { path: path.to_path_buf(), message: message.into() }
    }

    pub(crate) fn field(path: &Path, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Field { path: path.to_path_buf(), field: field.into(), message: message.into() }
    }

    pub(crate) fn tensor(path: &Path, tensor: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Tensor { path: path.to_path_buf(), tensor: tensor.into(), message: message.into() }
    }
}

pub type Result<T, E = LoadError> = std::result::Result<T, E>;
