//! 4-bit decoders (NF4/FP4 linears: QLoRA's frozen base). A checkpoint that transformers saved
//! with bitsandbytes 4-bit weights loads as stored; a float checkpoint is quantized layer by
//! layer while it loads (the float layer is dropped before the next one is read).

use std::path::Path;

use burn::tensor::backend::Backend;
use kiln::nn::Nf4Linear;
use kiln::ops::nf4::{Nf4Backend, QuantType, bnb};

use super::Decoder;
use super::build::{LinearShape, LoadOptions, MakeLinear, float_linear, load_made};
use crate::config::Family;
use crate::error::{LoadError, Result};
use crate::loader::{ParamKind, ParamSource};

/// A decoder whose attention and MLP linears are 4-bit.
pub type Nf4Decoder<B> = Decoder<B, Nf4Linear<B>>;

/// How float weights are quantized while loading (QLoRA's defaults: NF4, block 64, double
/// quantization). Checkpoints stored in 4 bits keep their own format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nf4Options {
    pub kind: QuantType,
    pub block: usize,
    pub double_quant: bool,
}

impl Default for Nf4Options {
    fn default() -> Self {
        Self { kind: QuantType::Nf4, block: 64, double_quant: true }
    }
}

/// Makes [`Nf4Linear`]s: from bitsandbytes' tensors where the checkpoint has them, else by
/// quantizing the float weight with its options.
#[derive(Debug, Clone, Copy, Default)]
pub struct Nf4Maker(pub Nf4Options);

impl<B: Nf4Backend> MakeLinear<B> for Nf4Maker {
    type Linear = Nf4Linear<B>;

    fn make<S: ParamSource>(&mut self, source: &mut S, name: &str, shape: LinearShape, device: &B::Device) -> Result<Nf4Linear<B>> {
        let weight = format!("{name}.weight");
        if !bnb::stored_4bit(&weight, |n| source.contains(n)) {
            let Nf4Options { kind, block, double_quant } = self.0;
            return Ok(Nf4Linear::from_linear(&float_linear(source, name, shape, device)?, kind, block, double_quant));
        }
        let bias = shape.bias.then(|| source.param::<B, 1>(&format!("{name}.bias"), [shape.d_output], ParamKind::Bias, device)).transpose()?;
        let path = source.origin().to_path_buf();
        let packed = bnb::from_bnb(&weight, |n| source.stored(n)).map_err(|e| LoadError::tensor(&path, &weight, e.0))?;
        if packed.shape != [shape.d_output, shape.d_input] {
            return Err(LoadError::tensor(&path, &weight, format!("4-bit shape {:?}; the config needs [{}, {}]", packed.shape, shape.d_output, shape.d_input)));
        }
        Nf4Linear::from_host(&packed, bias, device).map_err(|e| LoadError::tensor(&path, &weight, e.0))
    }

    fn consumes(&self, name: &str) -> bool {
        bnb::is_stored_part(name)
    }
}

/// Loads a checkpoint (HF directory or `.gguf`) with 4-bit attention and MLP linears; the
/// embedding, norms and head stay in `options.dtype`, as bitsandbytes leaves them.
pub fn load_nf4<B: Backend + Nf4Backend>(dir: &Path, options: &LoadOptions, nf4: Nf4Options, device: &B::Device) -> Result<(Family, Nf4Decoder<B>)> {
    load_made(dir, options, device, &mut Nf4Maker(nf4))
}
