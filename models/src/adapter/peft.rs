//! PEFT's LoRA files: `adapter_config.json` and `adapter_model.safetensors`, whose tensors are
//! named `base_model.model.<module path>.lora_A.weight` (`[r, in]`), `.lora_B.weight`
//! (`[out, r]`) and, for DoRA (`use_dora`), `.lora_magnitude_vector` (`[out]`). What PEFT saves
//! loads here, and what is saved here loads in PEFT.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use burn::module::Module;
use burn::tensor::{DType, FloatDType, Tensor, backend::Backend};
use kiln::nn::{LinearLayer, LoraAdapter, LoraConfig, LoraLinear};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use super::LoraDecoder;
use crate::error::{LoadError, Result};
use crate::loader::{ParamKind, ParamSource, SafetensorsSource};
use crate::model::Decoder;

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
const PREFIX: &str = "base_model.model.";

/// The fields of PEFT's `LoraConfig` that kiln reads and writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeftConfig {
    pub peft_type: String,
    #[serde(default)]
    pub task_type: Option<String>,
    pub r: usize,
    pub lora_alpha: f64,
    #[serde(default)]
    pub lora_dropout: f64,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default)]
    pub use_dora: bool,
    #[serde(default)]
    pub fan_in_fan_out: bool,
    #[serde(default = "no_bias")]
    pub bias: String,
    /// A trained bias on `lora_B` (PEFT ≥ 0.14).
    #[serde(default)]
    pub lora_bias: bool,
    #[serde(default)]
    pub target_modules: Option<TargetModules>,
    #[serde(default)]
    pub rank_pattern: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    pub alpha_pattern: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    #[serde(default)]
    pub inference_mode: bool,
}

fn no_bias() -> String {
    "none".into()
}

/// `target_modules`: a list of names or one pattern string.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    List(Vec<String>),
    Pattern(String),
}

impl PeftConfig {
    /// The adapter configuration these fields describe (`r` is the default rank; a layer's own
    /// rank comes from its tensors, which is how PEFT's `rank_pattern` ends up in the file).
    pub fn lora(&self) -> LoraConfig {
        LoraConfig::new()
            .with_rank(self.r)
            .with_alpha(self.lora_alpha)
            .with_dropout(self.lora_dropout)
            .with_rslora(self.use_rslora)
            .with_dora(self.use_dora)
    }

    /// Refuse what kiln does not apply, naming the field: a silent difference would change the
    /// model's outputs.
    fn check(&self, path: &Path) -> Result<()> {
        let refuse = |field: &str, why: &str| Err(LoadError::field(path, field, why));
        if self.peft_type != "LORA" {
            return refuse("peft_type", "only LORA adapters are read");
        }
        if self.fan_in_fan_out {
            return refuse("fan_in_fan_out", "Conv1D-style (GPT-2) weights are not supported");
        }
        if self.lora_bias {
            return refuse("lora_bias", "a bias on lora_B is not supported");
        }
        if self.bias != "none" {
            return refuse("bias", "trained biases are not supported (`none` only)");
        }
        if !self.alpha_pattern.is_empty() {
            return refuse("alpha_pattern", "per-layer alphas are not supported");
        }
        if self.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
            return refuse("modules_to_save", "fully trained extra modules are not supported");
        }
        if self.r == 0 || !self.lora_alpha.is_finite() || !(0.0..1.0).contains(&self.lora_dropout) {
            return refuse("r", "r must be ≥ 1, lora_alpha finite and lora_dropout in [0, 1)");
        }
        Ok(())
    }
}

/// Reads `dir/adapter_config.json` and `dir/adapter_model.safetensors` and puts their adapters on
/// the decoder's linears (frozen, as [`super::add_lora`] leaves them). Every tensor in the file
/// must belong to one of the decoder's linears, and every adapter must have both halves.
pub fn load_adapter<B: Backend, L: LinearLayer<B>>(decoder: Decoder<B, L>, dir: &Path) -> Result<LoraDecoder<B, L>> {
    let config_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&config_path).map_err(|e| LoadError::io(&config_path, e))?;
    let peft: PeftConfig = serde_json::from_str(&text).map_err(|e| LoadError::malformed(&config_path, format!("not a PEFT LoRA config: {e}")))?;
    peft.check(&config_path)?;
    let lora = peft.lora();
    let weights = dir.join(WEIGHTS_FILE);
    let dtype = FloatDType::from(decoder.dtype());
    let mut source = SafetensorsSource::open(&weights, dtype)?;
    let device = decoder.embed_tokens.weight.device();
    let mut unused: BTreeSet<String> = source.names().map(str::to_owned).collect();
    let mut failure = None;
    // Frozen as `add_lora` leaves a model; each layer gets its adapter in the same pass.
    let decoder = decoder.no_grad().map_linears(|name, base| {
        let layer = LoraLinear::frozen(base);
        if failure.is_some() {
            return layer;
        }
        match read_adapter(&mut source, name, &layer, &lora, &device) {
            Ok(None) => layer,
            Ok(Some((adapter, keys))) => {
                keys.iter().for_each(|k| {
                    unused.remove(k);
                });
                layer.with_adapter(adapter)
            }
            Err(e) => {
                failure = Some(e);
                layer
            }
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    if let Some(name) = unused.into_iter().next() {
        let why = if lora.dora { "not an adapter tensor of one of the model's attention or MLP linears" } else { "not the lora_A/lora_B of one of the model's attention or MLP linears (a magnitude needs use_dora)" };
        return Err(LoadError::tensor(&weights, name, why));
    }
    Ok(decoder)
}

/// The adapter of layer `name` if the file has one, with the keys it used.
fn read_adapter<B: Backend, L: LinearLayer<B>>(
    source: &mut SafetensorsSource,
    name: &str,
    layer: &LoraLinear<B, L>,
    lora: &LoraConfig,
    device: &B::Device,
) -> Result<Option<(LoraAdapter<B>, Vec<String>)>> {
    let (a_key, b_key) = (format!("{PREFIX}{name}.lora_A.weight"), format!("{PREFIX}{name}.lora_B.weight"));
    let (has_a, has_b) = (source.contains(&a_key), source.contains(&b_key));
    if !has_a && !has_b {
        return Ok(None);
    }
    let origin = source.origin().to_path_buf();
    let missing = if has_a { &b_key } else { &a_key };
    if !(has_a && has_b) {
        return Err(LoadError::tensor(&origin, missing, "missing: an adapter needs both lora_A and lora_B"));
    }
    let rank = source.shape(&a_key).and_then(|s| s.first().copied()).unwrap_or(0);
    if rank == 0 {
        return Err(LoadError::tensor(&origin, a_key, "must be [r, in] with r ≥ 1"));
    }
    let a: Tensor<B, 2> = source.param(&a_key, [rank, layer.base.d_input()], ParamKind::Bias, device)?;
    let b: Tensor<B, 2> = source.param(&b_key, [layer.base.d_output(), rank], ParamKind::Bias, device)?;
    let adapter = LoraAdapter::new(a, b, lora);
    if !lora.dora {
        return Ok(Some((adapter, vec![a_key, b_key])));
    }
    let m_key = format!("{PREFIX}{name}.lora_magnitude_vector");
    if !source.contains(&m_key) {
        return Err(LoadError::tensor(&origin, m_key, "missing: a DoRA adapter (use_dora) needs its magnitude"));
    }
    let magnitude: Tensor<B, 1> = source.param(&m_key, [layer.base.d_output()], ParamKind::Bias, device)?;
    Ok(Some((adapter.with_magnitude(magnitude), vec![a_key, b_key, m_key])))
}

/// Writes the decoder's adapters as PEFT files into `dir` (created if needed), in the adapters'
/// dtype. `base_model` goes to `base_model_name_or_path`. Adapters must share alpha, dropout,
/// rsLoRA and DoRA; ranks may differ (written as PEFT's `rank_pattern`).
pub fn save_adapter<B: Backend, L: LinearLayer<B>>(decoder: &LoraDecoder<B, L>, dir: &Path, base_model: Option<&str>) -> Result<()> {
    let config_path = dir.join(CONFIG_FILE);
    let adapters: Vec<(String, &LoraAdapter<B>)> =
        decoder.linears().into_iter().filter_map(|(name, layer)| layer.adapter.as_ref().map(|a| (name, a))).collect();
    let Some((_, first)) = adapters.first() else {
        return Err(LoadError::field(&config_path, "target_modules", "the model has no adapters to save"));
    };
    let shared = |a: &LoraAdapter<B>| (a.config.alpha.to_bits(), a.config.dropout.to_bits(), a.config.rslora, a.magnitude.is_some());
    if let Some((name, _)) = adapters.iter().find(|(_, a)| shared(a) != shared(first)) {
        return Err(LoadError::field(&config_path, name.clone(), "adapters with different alpha, dropout, rsLoRA or DoRA cannot share one PEFT config"));
    }
    let r = most_common(adapters.iter().map(|(_, a)| a.rank()));
    let rank_pattern = adapters.iter().filter(|(_, a)| a.rank() != r).map(|(n, a)| (n.clone(), serde_json::json!(a.rank()))).collect();
    let targets: BTreeSet<String> = adapters.iter().map(|(n, _)| n.rsplit('.').next().unwrap_or(n).to_owned()).collect();
    let peft = PeftConfig {
        peft_type: "LORA".into(),
        task_type: Some("CAUSAL_LM".into()),
        r,
        lora_alpha: first.config.alpha,
        lora_dropout: first.config.dropout,
        use_rslora: first.config.rslora,
        use_dora: first.magnitude.is_some(),
        fan_in_fan_out: false,
        bias: no_bias(),
        lora_bias: false,
        target_modules: Some(TargetModules::List(targets.into_iter().collect())),
        rank_pattern,
        alpha_pattern: BTreeMap::new(),
        modules_to_save: None,
        base_model_name_or_path: base_model.map(str::to_owned),
        inference_mode: true,
    };
    std::fs::create_dir_all(dir).map_err(|e| LoadError::io(dir, e))?;
    let json = serde_json::to_string_pretty(&peft).expect("a PEFT config serializes");
    std::fs::write(&config_path, json).map_err(|e| LoadError::io(&config_path, e))?;

    let mut tensors = Vec::with_capacity(3 * adapters.len());
    for (name, a) in &adapters {
        tensors.push((format!("{PREFIX}{name}.lora_A.weight"), a.lora_a.val().into_data()));
        tensors.push((format!("{PREFIX}{name}.lora_B.weight"), a.lora_b.val().into_data()));
        if let Some(m) = &a.magnitude {
            tensors.push((format!("{PREFIX}{name}.lora_magnitude_vector"), m.val().into_data()));
        }
    }
    let weights = dir.join(WEIGHTS_FILE);
    let views = tensors
        .iter()
        .map(|(key, data)| {
            let dtype = match data.dtype {
                DType::F32 => Dtype::F32,
                DType::F16 => Dtype::F16,
                DType::BF16 => Dtype::BF16,
                other => return Err(LoadError::tensor(&weights, key.clone(), format!("{other:?} cannot be saved (F32, F16 or BF16)"))),
            };
            let view = TensorView::new(dtype, data.shape.to_vec(), data.as_bytes()).map_err(|e| LoadError::tensor(&weights, key.clone(), e.to_string()))?;
            Ok((key.clone(), view))
        })
        .collect::<Result<HashMap<_, _>>>()?;
    let metadata = Some(HashMap::from([("format".to_owned(), "pt".to_owned())]));
    safetensors::serialize_to_file(views, metadata, &weights).map_err(|e| LoadError::malformed(&weights, e.to_string()))
}

fn most_common(values: impl Iterator<Item = usize>) -> usize {
    let mut counts = BTreeMap::new();
    values.for_each(|v| *counts.entry(v).or_insert(0usize) += 1);
    counts.into_iter().max_by_key(|&(v, n)| (n, std::cmp::Reverse(v))).map_or(0, |(v, _)| v)
}
