//! The tokenizer and chat templates against Python `tokenizers` and transformers'
//! `apply_chat_template` (`fixtures/tokenizer/expected.json`, from `make_fixtures.py`): a
//! byte-level BPE with Llama 3's split pattern, on text with Unicode, whitespace runs, digits,
//! code and special tokens.

use std::path::{Path, PathBuf};

use kiln_models::tokenizer::{ChatTemplate, Message, TextStream, Tokenizer};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("expected.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect()
}

#[test]
fn encodes_and_decodes_like_python() {
    let tokenizer = Tokenizer::from_file(&dir().join("tokenizer.json")).unwrap();
    for case in expected()["encodings"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tokenizer.encode(text, true).unwrap(), ids(&case["ids"]), "ids of {text:?}");
        assert_eq!(tokenizer.encode(text, false).unwrap(), ids(&case["ids_no_special"]), "ids without specials of {text:?}");
        let encoded = ids(&case["ids"]);
        assert_eq!(tokenizer.decode(&encoded, false).unwrap(), case["decoded"].as_str().unwrap());
        assert_eq!(tokenizer.decode(&encoded, true).unwrap(), case["decoded_skip"].as_str().unwrap());
    }
}

#[test]
fn streaming_decode_emits_the_whole_text_once() {
    let tokenizer = Tokenizer::from_file(&dir().join("tokenizer.json")).unwrap();
    let exp = expected();
    let text = exp["encodings"][0]["text"].as_str().unwrap();
    let mut stream = TextStream::default();
    let mut out = String::new();
    for id in tokenizer.encode(text, false).unwrap() {
        out += &stream.push(&tokenizer, id).unwrap();
    }
    // Multi-byte characters (emoji, CJK) span several byte-level tokens: pieces must never split them.
    assert_eq!(out, text);
}

#[test]
fn chat_templates_render_like_transformers() {
    let exp = expected();
    let messages: Vec<Vec<Message>> = serde_json::from_value(exp["messages"].clone()).unwrap();
    for family in ["llama3", "qwen2"] {
        let source = exp["templates"][family].as_str().unwrap().to_string();
        let template = ChatTemplate::new(source, Path::new("fixture")).unwrap();
        for (conversation, rendered) in messages.iter().zip(exp["rendered"][family].as_array().unwrap()) {
            let text = template.render(conversation, true, Some("<|begin_of_text|>"), Some("<|eot_id|>")).unwrap();
            assert_eq!(text, rendered.as_str().unwrap(), "{family} template");
        }
    }
}

#[test]
fn chat_template_read_from_tokenizer_config() {
    let tmp = tempdir("chat");
    std::fs::copy(dir().join("tokenizer.json"), tmp.join("tokenizer.json")).unwrap();
    let exp = expected();
    let config = serde_json::json!({
        "bos_token": {"content": "<|begin_of_text|>", "special": true},
        "eos_token": "<|eot_id|>",
        "chat_template": exp["templates"]["llama3"],
    });
    std::fs::write(tmp.join("tokenizer_config.json"), config.to_string()).unwrap();
    let tokenizer = Tokenizer::from_dir(&tmp).unwrap();
    let messages: Vec<Vec<Message>> = serde_json::from_value(exp["messages"].clone()).unwrap();
    let text = tokenizer.apply_chat_template(&messages[0], true).unwrap();
    assert_eq!(text, exp["rendered"]["llama3"][0].as_str().unwrap());
    let ids = tokenizer.encode_chat(&messages[0], true).unwrap();
    assert_eq!(ids.iter().filter(|&&i| Some(i) == tokenizer.token_id("<|begin_of_text|>")).count(), 1, "one BOS");

    // A template that raises gives an error naming the file and field, not a panic.
    std::fs::write(tmp.join("chat_template.jinja"), "{{ raise_exception('no system role') }}").unwrap();
    let err = Tokenizer::from_dir(&tmp).unwrap().apply_chat_template(&messages[0], true).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja") && err.contains("no system role"), "{err}");
}

#[test]
fn bad_tokenizer_files_are_errors() {
    let tmp = tempdir("bad");
    std::fs::write(tmp.join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let err = Tokenizer::from_dir(&tmp).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    let err = Tokenizer::from_dir(&tmp.join("missing")).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-models-tokenizer-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
