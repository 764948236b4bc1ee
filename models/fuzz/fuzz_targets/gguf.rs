//! Any bytes as a GGUF file: parsing, every tensor's dequantization, the decoder fields and the
//! tokenizer must return `Ok` or `Err`, never panic, hang or allocate without bound.
#![no_main]

use kiln_models::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for info in file.tensors() {
        if let Ok((dims, values)) = file.tensor_f32(&info.name) {
            assert_eq!(dims, info.dims);
            assert_eq!(values.len(), info.n_elements);
        }
        let _ = file.tensor_raw(&info.name);
    }
    let _ = file.decoder_fields();
    if let Ok(tokenizer) = file.tokenizer()
        && let Ok(encoding) = tokenizer.encode("Hello <s> world 12345 ▁é", true)
    {
        let _ = tokenizer.decode(encoding.get_ids(), false);
    }
});
