//! Instruction data for fine-tuning: the qlora example's JSONL (alpaca and chat lines), the loss
//! mask on the answers' tokens through the chat template, batching, and bad lines named.

use std::path::PathBuf;

use burn::backend::NdArray;
use burn::data::dataloader::batcher::Batcher;
use kiln_models::Tokenizer;
use kiln_models::data::{ResponseBatcher, Tokenized, read_jsonl};
use kiln_models::train::LmBatch;

fn example_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/qlora")
}

#[test]
fn both_formats_read_into_prompts_and_answers() {
    let examples = read_jsonl(&example_dir().join("data.jsonl")).unwrap();
    assert_eq!(examples.len(), 96);
    assert_eq!(examples[0].prompt.len(), 1);
    assert_eq!((examples[0].prompt[0].role.as_str(), examples[0].prompt[0].content.as_str()), ("user", "Reverse the letters of: heat"));
    assert_eq!(examples[0].response, "taeh");
    assert_eq!(examples[1].prompt[0].content, "What is 19 plus 26?");
    assert_eq!(examples[1].response, "45");
}

#[test]
fn only_the_answer_and_its_end_of_turn_are_predicted() {
    let tokenizer = Tokenizer::from_dir(&example_dir()).unwrap();
    let examples = read_jsonl(&example_dir().join("data.jsonl")).unwrap();
    let t = Tokenized::new(&tokenizer, &examples[0], 256).unwrap();
    let first = t.response.iter().position(|&r| r).unwrap();
    assert!(t.response[first..].iter().all(|&r| r), "the answer is one run at the end");
    assert_eq!(t.ids[..first], tokenizer.encode_chat(&examples[0].prompt, true).unwrap()[..]);
    let answer = tokenizer.decode(&t.ids[first..], false).unwrap();
    assert_eq!(answer, "taeh<|eot_id|>");
    let cut = Tokenized::new(&tokenizer, &examples[0], 5).unwrap();
    assert_eq!((cut.ids.len(), cut.response.len()), (5, 5));

    let items: Vec<Tokenized> = examples[..3].iter().map(|e| Tokenized::new(&tokenizer, e, 256).unwrap()).collect();
    let batch: LmBatch<NdArray> = ResponseBatcher { pad: 0 }.batch(items.clone(), &Default::default());
    let [b, len] = batch.inputs.dims();
    let longest = items.iter().map(|t| t.ids.len()).max().unwrap();
    assert_eq!((b, len), (3, longest - 1));
    let mask: Vec<f32> = batch.mask.unwrap().into_data().to_vec().unwrap();
    let targets: Vec<i64> = batch.targets.into_data().convert::<i64>().to_vec().unwrap();
    for (row, item) in items.iter().enumerate() {
        for p in 0..len {
            let predicted = p + 1 < item.ids.len() && item.response[p + 1];
            assert_eq!(mask[row * len + p] == 1.0, predicted, "row {row} position {p}");
            if p + 1 < item.ids.len() {
                assert_eq!(targets[row * len + p], item.ids[p + 1] as i64);
            }
        }
    }
}

#[test]
fn bad_lines_are_named() {
    let dir = std::env::temp_dir().join(format!("kiln-instruct-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        ("{\"instruction\": \"a\", \"output\": \"b\"}\n\n{\"prompt\": 1}\n", "line 3"),
        ("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n", "assistant"),
        ("{\"messages\": [{\"role\": \"assistant\", \"content\": \"hi\"}]}\n", "no prompt"),
        ("not json\n", "line 1"),
    ];
    for (i, (text, expected)) in cases.iter().enumerate() {
        let path = dir.join(format!("bad{i}.jsonl"));
        std::fs::write(&path, text).unwrap();
        let err = read_jsonl(&path).unwrap_err().to_string();
        assert!(err.contains(&format!("bad{i}.jsonl")) && err.contains(expected), "{err}");
    }
}
