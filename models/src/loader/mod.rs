//! Where a model's parameters come from: a checkpoint (HF safetensors, GGUF) or random
//! initialization.
//! The decoder is built by one function that asks a [`ParamSource`] for each parameter by its HF
//! name, so every format and the random init share the model's construction.

mod gguf;
mod safetensors;

use std::path::Path;

use burn::tensor::{Distribution, FloatDType, Tensor, TensorData, backend::Backend};
pub use kiln::ops::nf4::bnb::{Stored, StoredDtype};
use kiln::ops::ternary::TernaryMatrix;

pub use self::gguf::{GgufSource, config_from_gguf};
pub use self::safetensors::SafetensorsSource;
use crate::error::Result;

/// What a parameter is, which decides its layout in the file and its random initialization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A linear weight: HF stores `[out, in]`, the module keeps Burn's `[in, out]`.
    Linear,
    /// A bias (random init: zeros).
    Bias,
    /// An RMSNorm scale (random init: ones).
    Norm,
    /// The token embedding `[vocab, hidden]`.
    Embedding,
}

/// A provider of named parameters in the module's layout (`shape`) and dtype.
pub trait ParamSource {
    fn param<B: Backend, const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        kind: ParamKind,
        device: &B::Device,
    ) -> Result<Tensor<B, D>>;

    /// Whether the source holds `name` (e.g. `lm_head.weight` in a checkpoint with untied heads).
    fn contains(&self, name: &str) -> bool;

    /// The tensor `name` as stored in the file, for layers that read their own format
    /// (bitsandbytes' 4-bit weights); `None` when the source stores no such tensor.
    fn stored(&self, _name: &str) -> Option<Stored<'_>> {
        None
    }

    /// The linear weight `name` (`[n, k]`, HF's `[out, in]`) packed exactly, where the file
    /// stores it as ternary values (a `bitnet` GGUF); `None` where its weights are float, for a
    /// maker to quantize.
    fn ternary(&self, _name: &str, _n: usize, _k: usize) -> Option<Result<TernaryMatrix>> {
        None
    }

    /// The file parameters come from, for error messages.
    fn origin(&self) -> &Path;
}

/// Fresh parameters as HF initializes them: weights and embeddings from N(0, std²), biases 0,
/// norm scales 1.
#[derive(Debug, Clone)]
pub struct RandomInit {
    pub std: f64,
    pub dtype: FloatDType,
}

impl Default for RandomInit {
    fn default() -> Self {
        Self { std: 0.02, dtype: FloatDType::F32 }
    }
}

impl ParamSource for RandomInit {
    fn param<B: Backend, const D: usize>(&mut self, _: &str, shape: [usize; D], kind: ParamKind, device: &B::Device) -> Result<Tensor<B, D>> {
        let t: Tensor<B, D> = match kind {
            ParamKind::Linear | ParamKind::Embedding => Tensor::random(shape, Distribution::Normal(0.0, self.std), device),
            ParamKind::Bias => Tensor::zeros(shape, device),
            ParamKind::Norm => Tensor::ones(shape, device),
        };
        Ok(t.cast(self.dtype))
    }

    fn origin(&self) -> &Path {
        Path::new("<random init>")
    }

    /// Every parameter, and none of bitsandbytes' 4-bit parts or BitNet's packed scales: the
    /// weights it makes are float.
    fn contains(&self, name: &str) -> bool {
        !kiln::ops::nf4::bnb::is_stored_part(name) && !name.ends_with(".weight_scale")
    }
}

/// `[rows, cols]` row-major elements of `size` bytes → `[cols, rows]`.
pub(crate) fn transpose_bytes(bytes: &[u8], rows: usize, cols: usize, size: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for (r, row) in bytes.chunks_exact(cols * size).enumerate() {
        for (c, element) in row.chunks_exact(size).enumerate() {
            let at = (c * rows + r) * size;
            out[at..at + size].copy_from_slice(element);
        }
    }
    out
}

/// Upload host data in `dtype` (converted on the host if stored otherwise).
pub(crate) fn upload<B: Backend, const D: usize>(data: TensorData, dtype: FloatDType, device: &B::Device) -> Tensor<B, D> {
    Tensor::from_data(data.convert_dtype(dtype.into()), (device, burn::tensor::DType::from(dtype)))
}

#[cfg(test)]
mod tests {
    use super::{RandomInit, transpose_bytes};
    use crate::{DecoderConfig, Nf4Maker, TernaryMaker, build_with};
    use burn::backend::NdArray;

    /// Random initialization makes float layers (the pretrain example) and, through the NF4 and
    /// ternary makers, quantized ones (the qlora_step example): it never claims a stored 4-bit
    /// or packed ternary weight.
    #[test]
    fn random_init_builds_float_and_quantized_models() {
        let config = DecoderConfig::preset("tiny").unwrap();
        let float = config.init::<NdArray>(&Default::default());
        assert_eq!(float.layers.len(), config.num_layers);
        let nf4 = build_with::<NdArray, _, _>(&config, &mut RandomInit::default(), &Default::default(), &mut Nf4Maker::default()).unwrap();
        assert_eq!(nf4.linears().len(), 7 * config.num_layers);
        let ternary = build_with::<NdArray, _, _>(&config, &mut RandomInit::default(), &Default::default(), &mut TernaryMaker::default()).unwrap();
        assert_eq!(ternary.linears().len(), 7 * config.num_layers);
    }

    #[test]
    fn transposes_rows_and_columns() {
        // [[1, 2, 3], [4, 5, 6]] as u16 → [[1, 4], [2, 5], [3, 6]]
        let bytes: Vec<u8> = [1u16, 2, 3, 4, 5, 6].iter().flat_map(|v| v.to_le_bytes()).collect();
        let out: Vec<u16> = transpose_bytes(&bytes, 2, 3, 2).chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        assert_eq!(out, [1, 4, 2, 5, 3, 6]);
    }
}
