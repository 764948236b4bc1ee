//! Any bytes as a safetensors file (written to a temp file, since `SafetensorsSource` opens paths):
//! opening must return `Ok` or `Err`, never panic.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use burn::tensor::FloatDType;
use kiln_models::loader::SafetensorsSource;
use libfuzzer_sys::fuzz_target;

fn input_path() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| std::env::temp_dir().join(format!("kiln-models-fuzz-{}.safetensors", std::process::id())))
}

fuzz_target!(|data: &[u8]| {
    let path = input_path();
    std::fs::write(path, data).expect("writing the input to a temp file");
    if let Ok(source) = SafetensorsSource::open(path, FloatDType::F32) {
        let _ = source.names().count();
        let _ = source.total_bytes();
    }
});
