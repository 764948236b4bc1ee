//! The tokenizer a GGUF file carries in its `tokenizer.ggml.*` metadata, rebuilt as a HF
//! `tokenizers::Tokenizer`:
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE from `tokens` and `merges`, split first by the
//!   regex `tokenizer.ggml.pre` names (`llama-bpe`/`llama3`: Llama 3's; `qwen2`: Qwen2's, after
//!   NFC; absent or `default`/`gpt2`: GPT-2's);
//! - `tokenizer.ggml.model = "llama"`: SentencePiece BPE from `tokens` and `scores`, with the merges
//!   derived from the scores as HF's `SentencePieceExtractor` does, byte fallback to `<0xNN>`,
//!   spaces as `▁` and a space prepended (`tokenizer.ggml.add_space_prefix`, default true), as HF's
//!   (legacy) `LlamaConverter` builds it.
//!
//! Tokens of type 3 (control) become special added tokens, of type 4 (user-defined) non-special
//! added tokens. BOS/EOS are added by the post-processor per `tokenizer.ggml.add_bos_token` /
//! `add_eos_token` (defaults: BOS for `llama` and Llama 3, none otherwise, as llama.cpp does).

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{NFC, Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
    Tokenizer,
};

use super::GgufFile;
use crate::error::{LoadError, Result};

/// Llama 3's split regex (`llama-bpe`).
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex: Llama 3's with single digits.
pub const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const TOKENS: &str = "tokenizer.ggml.tokens";
const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const MERGES: &str = "tokenizer.ggml.merges";
const SCORES: &str = "tokenizer.ggml.scores";
const PRE: &str = "tokenizer.ggml.pre";

/// The longest SentencePiece piece (bytes) that merges are derived for (SentencePiece's own
/// `max_piece_length` defaults to 16 characters).
const MAX_MERGED_PIECE: usize = 256;

/// llama.cpp's token types.
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

enum Pre {
    Gpt2,
    Llama3,
    Qwen2,
}

impl GgufFile {
    /// The tokenizer stored in the metadata (see the module docs for what is supported).
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        match self.str("tokenizer.ggml.model")? {
            "gpt2" => self.bpe_tokenizer(),
            "llama" => self.spm_tokenizer(),
            other => Err(LoadError::field(
                self.path(),
                "tokenizer.ggml.model",
                format!("unsupported tokenizer model {other:?} (supported: \"gpt2\", \"llama\")"),
            )),
        }
    }

    fn err(&self, key: &str, msg: impl Into<String>) -> LoadError {
        LoadError::field(self.path(), key, msg)
    }

    /// The token list, its vocab map (first id of a repeated string wins) and the token types.
    fn vocab_parts(&self) -> Result<(&[String], Vocab, Vec<i32>)> {
        let tokens = self.str_array(TOKENS)?;
        if tokens.is_empty() || u32::try_from(tokens.len()).is_err() {
            return Err(self.err(TOKENS, format!("{} tokens", tokens.len())));
        }
        let types = match self.get(TOKEN_TYPE) {
            None => vec![1; tokens.len()],
            Some(_) => {
                let t = self.i32_array(TOKEN_TYPE)?;
                if t.len() != tokens.len() {
                    return Err(self.err(TOKEN_TYPE, format!("{} types for {} tokens", t.len(), tokens.len())));
                }
                t.to_vec()
            }
        };
        let mut vocab = Vocab::default();
        for (id, t) in tokens.iter().enumerate() {
            vocab.entry(t.clone()).or_insert(id as u32);
        }
        Ok((tokens, vocab, types))
    }

    /// A token id under `key`, checked against the vocabulary size.
    fn token_id(&self, key: &str, n_tokens: usize) -> Result<Option<u32>> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(id) if id < n_tokens as u64 => Ok(Some(id as u32)),
            Some(id) => Err(self.err(key, format!("token id {id} is not below the vocabulary size {n_tokens}"))),
        }
    }

    fn bpe_tokenizer(&self) -> Result<Tokenizer> {
        let (tokens, vocab, types) = self.vocab_parts()?;
        let pre = match self.opt_str(PRE)? {
            None | Some("default" | "gpt2" | "gpt-2") => Pre::Gpt2,
            Some("llama-bpe" | "llama3" | "llama-v3") => Pre::Llama3,
            Some("qwen2") => Pre::Qwen2,
            Some(other) => {
                return Err(self.err(
                    PRE,
                    format!("unsupported pre-tokenizer {other:?} (supported: llama-bpe, llama3, qwen2, default)"),
                ));
            }
        };
        let merges = self
            .str_array(MERGES)?
            .iter()
            .enumerate()
            .map(|(i, m)| match m.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => {
                    Ok((a.to_string(), b.to_string()))
                }
                _ => Err(self.err(MERGES, format!("merge {i} {m:?} is not two tokens separated by a space"))),
            })
            .collect::<Result<Vec<_>>>()?;
        let model = BPE::builder()
            .vocab_and_merges(vocab, merges)
            // Llama 3 (HF and llama.cpp) takes a pre-token that is itself a token without merging.
            .ignore_merges(matches!(pre, Pre::Llama3))
            .build()
            .map_err(|e| self.err(MERGES, e.to_string()))?;
        let mut tok = Tokenizer::new(model);
        let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
            let s = Split::new(SplitPattern::Regex(pattern.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| self.err(PRE, format!("regex: {e}")))?;
            Ok(s.into())
        };
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            Pre::Gpt2 => ByteLevel::new(false, true, true).into(),
            Pre::Llama3 => {
                PreTokenizerSequence::new(vec![split(LLAMA3_PATTERN)?, ByteLevel::new(false, true, false).into()])
                    .into()
            }
            Pre::Qwen2 => {
                tok.with_normalizer(Some(NormalizerWrapper::from(NFC)));
                PreTokenizerSequence::new(vec![split(QWEN2_PATTERN)?, ByteLevel::new(false, false, false).into()])
                    .into()
            }
        };
        tok.with_pre_tokenizer(Some(pre_tokenizer));
        tok.with_decoder(Some(DecoderWrapper::from(ByteLevel::default())));
        self.add_special_tokens(&mut tok, tokens, &types);
        let default_bos = matches!(pre, Pre::Llama3);
        self.post_processor(&mut tok, tokens, default_bos, Some(ByteLevel::new(false, false, false).into()))?;
        Ok(tok)
    }

    fn spm_tokenizer(&self) -> Result<Tokenizer> {
        let (tokens, vocab, types) = self.vocab_parts()?;
        let scores = self.f32_array(SCORES)?;
        if scores.len() != tokens.len() {
            return Err(self.err(SCORES, format!("{} scores for {} tokens", scores.len(), tokens.len())));
        }
        let merges = match self.get(MERGES) {
            // A few converters store SentencePiece merges; use them as given.
            Some(_) => self
                .str_array(MERGES)?
                .iter()
                .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())))
                .collect(),
            None => spm_merges(tokens, scores, &types, &vocab),
        };
        let unk = match self.token_id("tokenizer.ggml.unknown_token_id", tokens.len())? {
            Some(id) => Some(tokens[id as usize].clone()),
            None => vocab.contains_key("<unk>").then(|| "<unk>".to_string()),
        };
        let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
        if let Some(unk) = unk {
            builder = builder.unk_token(unk);
        }
        let model = builder.build().map_err(|e| self.err(SCORES, format!("derived merges: {e}")))?;
        let mut tok = Tokenizer::new(model);
        let add_space_prefix = self.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        let space = |e: tokenizers::Error| self.err(TOKENS, e.to_string());
        let replace = Replace::new(" ", "▁").map_err(space)?;
        let normalizer: NormalizerWrapper = if add_space_prefix {
            NormalizerSequence::new(vec![Prepend::new("▁".into()).into(), replace.into()]).into()
        } else {
            replace.into()
        };
        tok.with_normalizer(Some(normalizer));
        let mut decoders: Vec<DecoderWrapper> =
            vec![Replace::new("▁", " ").map_err(space)?.into(), ByteFallback::new().into(), Fuse::new().into()];
        if add_space_prefix {
            decoders.push(Strip::new(' ', 1, 0).into());
        }
        tok.with_decoder(Some(DecoderSequence::new(decoders)));
        self.add_special_tokens(&mut tok, tokens, &types);
        self.post_processor(&mut tok, tokens, true, None)?;
        Ok(tok)
    }

    fn add_special_tokens(&self, tok: &mut Tokenizer, tokens: &[String], types: &[i32]) {
        let added = |ty: i32, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(types)
                .filter(|(t, y)| **y == ty && !t.is_empty())
                .map(|(t, _)| AddedToken::from(t.clone(), special).normalized(false))
                .collect()
        };
        tok.add_special_tokens(&added(TYPE_CONTROL, true));
        tok.add_tokens(&added(TYPE_USER_DEFINED, false));
    }

    /// BOS/EOS around each sequence, or `otherwise` when neither is added.
    fn post_processor(
        &self,
        tok: &mut Tokenizer,
        tokens: &[String],
        default_bos: bool,
        otherwise: Option<PostProcessorWrapper>,
    ) -> Result<()> {
        let n = tokens.len();
        let bos_id = self.token_id("tokenizer.ggml.bos_token_id", n)?;
        let eos_id = self.token_id("tokenizer.ggml.eos_token_id", n)?;
        let add_bos = self.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_bos && bos_id.is_some());
        let add_eos = self.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let mut specials = Vec::new();
        let mut ends = |add: bool, id: Option<u32>, name: &str, key: &str| -> Result<(String, String)> {
            if !add {
                return Ok((String::new(), String::new()));
            }
            let id = id.ok_or_else(|| self.err(key, format!("missing, but {name} is to be added")))?;
            specials.push(
                SpecialToken::new(name.to_string(), vec![id], vec![tokens[id as usize].clone()])
                    .map_err(|e| self.err(key, e.to_string()))?,
            );
            Ok((format!("{name} "), format!("{name}:1 ")))
        };
        let (bos, bos1) = ends(add_bos, bos_id, "bos", "tokenizer.ggml.bos_token_id")?;
        let (eos, eos1) = ends(add_eos, eos_id, "eos", "tokenizer.ggml.eos_token_id")?;
        if specials.is_empty() {
            tok.with_post_processor(otherwise);
            return Ok(());
        }
        let template = TemplateProcessing::builder()
            .try_single(format!("{bos}$A:0 {eos}").trim_end().to_string())
            .and_then(|b| b.try_pair(format!("{bos}$A:0 {eos}{bos1}$B:1 {eos1}").trim_end().to_string()))
            .map_err(|e| self.err("tokenizer.ggml.add_bos_token", e))?
            .special_tokens(specials)
            .build()
            .map_err(|e| self.err("tokenizer.ggml.add_bos_token", e.to_string()))?;
        tok.with_post_processor(Some(template));
        Ok(())
    }
}

/// SentencePiece BPE merges from the pieces' scores, as HF's converter derives them: every split of
/// a normal piece (token type 1, or 0: undefined) into two normal pieces is a merge, and merges rank
/// by the merged piece's score, highest first; ties go to the lower piece id, then to the shorter
/// left part. (SentencePiece itself merges, at each step, the adjacent pair whose merged piece scores
/// highest.) Pieces longer than [`MAX_MERGED_PIECE`] bytes get no merges: real ones are a few
/// characters, and each split costs a lookup of its halves.
pub(super) fn spm_merges(tokens: &[String], scores: &[f32], types: &[i32], vocab: &Vocab) -> Vec<(String, String)> {
    let normal = |id: u32| matches!(types.get(id as usize), Some(0 | 1) | None);
    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    for (id, (piece, &score)) in tokens.iter().zip(scores).enumerate() {
        if piece.len() > MAX_MERGED_PIECE || !normal(id as u32) || vocab.get(piece) != Some(&(id as u32)) {
            continue;
        }
        // -0.0 ranks with 0.0, as in Python.
        let score = if score == 0.0 { 0.0 } else { score };
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if vocab.get(l).is_some_and(|&i| normal(i)) && vocab.get(r).is_some_and(|&i| normal(i)) {
                merges.push((l, r, score));
            }
        }
    }
    // Stable: equal scores keep piece-id and split order. total_cmp: NaN scores cannot break the sort.
    merges.sort_by(|x, y| y.2.total_cmp(&x.2));
    merges.into_iter().map(|(a, b, _)| (a.to_string(), b.to_string())).collect()
}
