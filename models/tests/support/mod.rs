//! Helpers shared by kiln-models' checkpoint tests: fixture paths, damaged copies of a fixture's
//! safetensors file, logit errors.

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

/// One stored tensor, editable: name, dtype, shape, bytes.
pub type StoredTensor = (String, Dtype, Vec<usize>, Vec<u8>);

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A copy of checkpoint directory `src` (its `config.json` and `model.safetensors`) in a fresh
/// directory, with `edit` applied to its tensors.
pub fn damaged(src: &Path, tag: &str, edit: impl Fn(&mut Vec<StoredTensor>)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-damaged-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<StoredTensor> = file.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        tensors.iter().map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

/// The largest absolute difference (NaN counts as infinite).
pub fn max_abs_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| if x.is_nan() { f64::INFINITY } else { (x - y).abs() }).fold(0.0, f64::max)
}
