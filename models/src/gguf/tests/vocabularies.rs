//! Tokenizers from GGUF's embedded vocabularies (GPT-2 BPE and SentencePiece) against the fixture.

use super::*;

fn fixture(path: &str) -> serde_json::Value {
    let p = format!("{}/tests/fixtures/tokenizer/{path}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"))).unwrap()
}

/// The fixture tokenizer.json as llama.cpp's converter stores it (`gpt2`, `llama-bpe`).
fn gpt2_writer(pre: &str, add_bos: Option<bool>) -> Writer {
    let t = fixture("tokenizer.json");
    let vocab = t["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (tok, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = tok.clone();
    }
    let mut types = vec![1; tokens.len()];
    for a in t["added_tokens"].as_array().unwrap() {
        let id = a["id"].as_u64().unwrap() as usize;
        assert_eq!(tokens[id], a["content"].as_str().unwrap());
        types[id] = if a["special"].as_bool().unwrap() { 3 } else { 4 };
    }
    let merges: Vec<String> = t["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => s.clone(),
            pair => format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap()),
        })
        .collect();
    let tokens: Vec<&str> = tokens.iter().map(|s| s.as_str()).collect();
    let merges: Vec<&str> = merges.iter().map(|s| s.as_str()).collect();
    let w = Writer::new()
        .str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", pre)
        .str_array("tokenizer.ggml.tokens", &tokens)
        .i32_array("tokenizer.ggml.token_type", &types)
        .str_array("tokenizer.ggml.merges", &merges)
        .u32("tokenizer.ggml.bos_token_id", 0)
        .u32("tokenizer.ggml.eos_token_id", 4);
    match add_bos {
        Some(b) => w.bool("tokenizer.ggml.add_bos_token", b),
        None => w,
    }
}

#[test]
fn gpt2_tokenizer_matches_the_fixture() {
    let tok = gpt2_writer("llama-bpe", Some(true)).parse().unwrap().tokenizer().unwrap();
    let expected = fixture("expected.json");
    for case in expected["encodings"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = |k: &str| case[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let enc = tok.encode(text, true).unwrap();
        assert_eq!(enc.get_ids(), ids("ids"), "{text:?}");
        assert_eq!(tok.encode(text, false).unwrap().get_ids(), ids("ids_no_special"), "{text:?}");
        assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), case["decoded"].as_str().unwrap(), "{text:?}");
        assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), case["decoded_skip"].as_str().unwrap(), "{text:?}");
    }
    assert_eq!(tok.get_vocab_size(true), 320);
    assert_eq!(tok.token_to_id("<|eot_id|>"), Some(4));

    // Qwen2 and GPT-2 splitting also build; Qwen2 splits digits one by one.
    let qwen = gpt2_writer("qwen2", None).parse().unwrap().tokenizer().unwrap();
    let digits = qwen.encode("12345", true).unwrap();
    assert_eq!(digits.get_ids().len(), 5);
    assert!(digits.get_ids()[0] != 0, "no BOS by default for qwen2");
    let gpt2 = gpt2_writer("default", None).parse().unwrap().tokenizer().unwrap();
    assert_eq!(gpt2.decode(gpt2.encode("it's 12345 ok", false).unwrap().get_ids(), false).unwrap(), "it's 12345 ok");

    let e = gpt2_writer("deepseek-llm", None).parse().unwrap().tokenizer().unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.pre") && e.contains("deepseek-llm"), "{e}");
}

#[test]
fn tokenizer_errors_name_the_key() {
    let base =
        || Writer::new().str("tokenizer.ggml.model", "gpt2").str_array("tokenizer.ggml.tokens", &["a", "b", "ab"]);
    let e = base().parse().unwrap().tokenizer().unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.merges") && e.contains("missing"), "{e}");
    let e = base().str_array("tokenizer.ggml.merges", &["a c"]).parse().unwrap().tokenizer().unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.merges"), "{e}");
    let e = base().str_array("tokenizer.ggml.merges", &["abc"]).parse().unwrap().tokenizer().unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.merges") && e.contains("merge 0"), "{e}");
    let e = base()
        .str_array("tokenizer.ggml.merges", &["a b"])
        .i32_array("tokenizer.ggml.token_type", &[1])
        .parse()
        .unwrap()
        .tokenizer()
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer.ggml.token_type"), "{e}");
    let e = base()
        .str_array("tokenizer.ggml.merges", &["a b"])
        .u32("tokenizer.ggml.bos_token_id", 3)
        .parse()
        .unwrap()
        .tokenizer()
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer.ggml.bos_token_id"), "{e}");
    let ok = base().str_array("tokenizer.ggml.merges", &["a b"]).parse().unwrap().tokenizer().unwrap();
    assert_eq!(ok.encode("ab", false).unwrap().get_ids(), &[2]);
    let e = Writer::new().str("tokenizer.ggml.model", "bert").parse().unwrap().tokenizer().unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.model") && e.contains("bert"), "{e}");
    let e = Writer::new().parse().unwrap().tokenizer().unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.model") && e.contains("missing"), "{e}");
}

/// A small SentencePiece vocabulary as llama.cpp stores it: `<unk>`, `<s>`, `</s>`, the 256 byte
/// pieces, then pieces with scores (higher merges first).
fn spm_writer() -> Writer {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces = [
        ("▁t", -1.0),
        ("he", -2.0),
        ("▁the", -3.0),
        ("ll", -4.0),
        ("▁he", -5.0),
        ("llo", -6.0),
        ("▁hello", -7.0),
        ("▁", -8.0),
        ("t", -9.0),
        ("h", -10.0),
        ("e", -11.0),
        ("l", -12.0),
        ("o", -13.0),
        ("w", -14.0),
        ("r", -15.0),
        ("d", -16.0),
    ];
    for (p, s) in pieces {
        tokens.push(p.into());
        types.push(1);
        scores.push(s);
    }
    let tokens: Vec<&str> = tokens.iter().map(|s| s.as_str()).collect();
    Writer::new()
        .str("tokenizer.ggml.model", "llama")
        .str_array("tokenizer.ggml.tokens", &tokens)
        .f32_array("tokenizer.ggml.scores", &scores)
        .i32_array("tokenizer.ggml.token_type", &types)
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2)
        .u32("tokenizer.ggml.unknown_token_id", 0)
}

#[test]
fn spm_tokenizer_merges_by_score_and_falls_back_to_bytes() {
    let f = spm_writer().parse().unwrap();
    let tok = f.tokenizer().unwrap();
    let id = |t: &str| tok.token_to_id(t).unwrap();
    let enc = tok.encode("hello the world", true).unwrap();
    assert_eq!(enc.get_tokens(), ["<s>", "▁hello", "▁the", "▁", "w", "o", "r", "l", "d"], "{:?}", enc.get_tokens());
    assert_eq!(enc.get_ids()[..3], [1, id("▁hello"), id("▁the")]);
    assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "hello the world");
    // Characters outside the vocabulary fall back to their UTF-8 bytes.
    let enc = tok.encode("hé", false).unwrap();
    assert_eq!(enc.get_tokens(), ["▁", "h", "<0xC3>", "<0xA9>"]);
    assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), "hé");
    // Special tokens in text are matched, and a space is prepended after them (llama.cpp does too).
    let enc = tok.encode("<s>hello", false).unwrap();
    assert_eq!(enc.get_tokens(), ["<s>", "▁hello"]);

    // The derived merges rank by the merged piece's score.
    let tokens = f.str_array("tokenizer.ggml.tokens").unwrap();
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.clone(), i as u32);
    }
    let types = f.i32_array("tokenizer.ggml.token_type").unwrap();
    let merges = vocab::spm_merges(tokens, f.f32_array("tokenizer.ggml.scores").unwrap(), types, &vocab);
    let m: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    assert_eq!(m, ["▁ t", "h e", "▁t he", "l l", "▁ he", "ll o", "▁he llo"]);
}

/// A gpt2 vocabulary with empty and repeated token strings, a control token that is empty and odd
/// merges, which adds BOS and EOS but names no EOS id.
fn odd_gpt2_vocabulary() -> Writer {
    Writer::new()
        .str("tokenizer.ggml.model", "gpt2")
        .str_array("tokenizer.ggml.tokens", &["", "a", "a", "<s>", "aa", "Ġ"])
        .i32_array("tokenizer.ggml.token_type", &[3, 1, 3, 3, 4, 1])
        .str_array("tokenizer.ggml.merges", &["a a"])
        .u32("tokenizer.ggml.bos_token_id", 3)
        .bool("tokenizer.ggml.add_bos_token", true)
        .bool("tokenizer.ggml.add_eos_token", true)
}

#[test]
fn tokenizer_survives_odd_vocabularies() {
    let f = odd_gpt2_vocabulary().parse().unwrap();
    let e = f.tokenizer().unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.eos_token_id") && e.contains("missing"), "{e}");
    let f = odd_gpt2_vocabulary().u32("tokenizer.ggml.eos_token_id", 0).parse().unwrap();
    let tok = f.tokenizer().unwrap();
    let enc = tok.encode("aaa <s>", true).unwrap();
    assert_eq!(enc.get_ids().first(), Some(&3));
    assert_eq!(enc.get_ids().last(), Some(&0));
    let _ = tok.decode(enc.get_ids(), false).unwrap();
    let pair = tok.encode(("a", "aa"), true).unwrap();
    assert_eq!(pair.get_ids().iter().filter(|&&i| i == 3).count(), 2);

    // SentencePiece with NaN and infinite scores, empty pieces and no <unk>.
    let f = Writer::new()
        .str("tokenizer.ggml.model", "llama")
        .str_array("tokenizer.ggml.tokens", &["", "▁", "a", "▁a", "aa", "a"])
        .f32_array("tokenizer.ggml.scores", &[f32::NAN, f32::INFINITY, -0.0, 0.0, f32::NEG_INFINITY, f32::NAN])
        .bool("tokenizer.ggml.add_space_prefix", false)
        .parse()
        .unwrap();
    let tok = f.tokenizer().unwrap();
    let enc = tok.encode("aa a b", false).unwrap();
    let _ = tok.decode(enc.get_ids(), false).unwrap();
    let e = Writer::new()
        .str("tokenizer.ggml.model", "llama")
        .str_array("tokenizer.ggml.tokens", &["a"])
        .f32_array("tokenizer.ggml.scores", &[0.0, 1.0])
        .parse()
        .unwrap()
        .tokenizer()
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer.ggml.scores"), "{e}");
    let e = Writer::new()
        .str("tokenizer.ggml.model", "llama")
        .str_array("tokenizer.ggml.tokens", &[])
        .parse()
        .unwrap()
        .tokenizer()
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer.ggml.tokens"), "{e}");
}
