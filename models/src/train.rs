//! Training a decoder with Burn's `Learner`: next-token batches, the loss (optionally on masked
//! positions only, e.g. the response of an instruction pair), `TrainStep`/`InferenceStep` for
//! [`Decoder`], and a compact progress renderer for runs without a terminal (Burn's TUI draws
//! when one is attached).

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::OnceLock;

use burn::backend::Flex;
use burn::module::{AutodiffModule, ModuleDisplay};
use burn::tensor::{Int, Tensor, backend::{AutodiffBackend, Backend}};
use burn::train::metric::{Adaptor, ItemLazy, LossInput, MetricDefinition, MetricId};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation, MetricsRendererTraining, ProgressType,
    TrainingProgress,
};
use burn::train::{InferenceStep, TrainOutput, TrainStep};
use kiln::KilnBackend;
use kiln::ops::linear_cross_entropy::{LinearCrossEntropyOptions, Reduction};

use crate::model::{Decoder, Projection};

/// Inputs and next-token targets `[batch, seq]`; `mask` (1 = counted) limits the loss to some
/// positions.
#[derive(Debug, Clone)]
pub struct LmBatch<B: Backend> {
    pub inputs: Tensor<B, 2, Int>,
    pub targets: Tensor<B, 2, Int>,
    pub mask: Option<Tensor<B, 2>>,
}

/// A language-model step's output for Burn's metrics (`LossMetric`): the loss alone. The logits
/// are never formed whole ([`Decoder::lm_loss`]), and Burn's `ClassificationOutput` would copy
/// them to the host at every step to feed accuracy metrics (2.1 GB at 8192 tokens of a 128k
/// vocabulary).
#[derive(Debug, Clone)]
pub struct LmOutput<B: Backend> {
    /// The mean cross-entropy over the counted positions, `[1]`.
    pub loss: Tensor<B, 1>,
}

/// Synced to the host as Burn's own outputs are (its `Flex` backend), so that one metric serves
/// the training and the validation steps.
impl<B: Backend> ItemLazy for LmOutput<B> {
    type ItemSync = LmOutput<Flex>;

    fn sync(self) -> LmOutput<Flex> {
        LmOutput { loss: Tensor::from_data(self.loss.into_data(), &Default::default()) }
    }
}

impl<B: Backend> Adaptor<LossInput<B>> for LmOutput<B> {
    fn adapt(&self) -> LossInput<B> {
        LossInput::new(self.loss.clone())
    }
}

impl<B: KilnBackend, L: Projection<B>> Decoder<B, L> {
    /// Mean cross-entropy of the next-token predictions (over masked positions when a mask is
    /// given), in f32. A frozen head (LoRA and QLoRA fine-tuning, evaluation) goes through kiln's
    /// fused `linear_cross_entropy`: the head's product and the loss chunked over positions, so
    /// that the `[tokens, vocab]` logits and their gradient are never held whole. A trained head
    /// (and a head with a bias, which the loaders never build) takes the whole logits and kiln's
    /// `cross_entropy`: with the head's weight gradient summed over chunks the fused op ran
    /// 0.93–0.98× as fast, and a whole QAT or float training step reserved 1.1 GB more device
    /// memory (RESULTS, 43rd session, H200). `KILN_LM_LOSS=fused|logits` forces one path for any
    /// head without a bias (for measuring one against the other).
    pub fn lm_loss(&self, batch: LmBatch<B>) -> LmOutput<B> {
        let hidden = self.hidden(batch.inputs, None, &[]);
        let [b, s, d] = hidden.dims();
        let mut targets = batch.targets.reshape([b * s]);
        if let Some(mask) = batch.mask {
            // Uncounted positions take PyTorch's ignore index, which the loss leaves out.
            targets = targets.mask_fill(mask.reshape([b * s]).lower_equal_elem(0.0), -100);
        }
        // The parameter itself: a tied head's transposed view is not a leaf, and autodiff reports
        // `require_grad` on leaves only.
        let trained = match &self.lm_head {
            Some(head) => head.weight.val().is_require_grad(),
            None => self.embed_tokens.weight.val().is_require_grad(),
        };
        let biased = self.lm_head.as_ref().is_some_and(|head| head.bias.is_some());
        if biased || whole_logits_forced().unwrap_or(trained) {
            let logits = self.logits(hidden).reshape([b * s, self.config.vocab_size]);
            let counted = targets.clone().greater_equal_elem(0).float().sum().clamp_min(1.0);
            return LmOutput { loss: kiln::ops::cross_entropy(logits, targets).sum() / counted };
        }
        let options = LinearCrossEntropyOptions { reduction: Reduction::Mean, chunk_rows: None };
        LmOutput { loss: kiln::ops::linear_cross_entropy(hidden.reshape([b * s, d]), self.head_weight(), targets, options) }
    }
}

/// Whether `KILN_LM_LOSS` forces the loss over the whole logits (`logits`: `Some(true)`) or the
/// fused op (`fused`: `Some(false)`); `None` when unset (chosen by the head).
fn whole_logits_forced() -> Option<bool> {
    static FORCED: OnceLock<Option<bool>> = OnceLock::new();
    *FORCED.get_or_init(|| match std::env::var("KILN_LM_LOSS").as_deref() {
        Ok("logits") => Some(true),
        Ok("fused") => Some(false),
        _ => None,
    })
}

impl<B, L> TrainStep for Decoder<B, L>
where
    B: KilnBackend + AutodiffBackend,
    L: Projection<B> + AutodiffModule<B> + ModuleDisplay,
    L::InnerModule: ModuleDisplay,
{
    type Input = LmBatch<B>;
    type Output = LmOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> TrainOutput<LmOutput<B>> {
        let item = self.lm_loss(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: KilnBackend, L: Projection<B>> InferenceStep for Decoder<B, L> {
    type Input = LmBatch<B>;
    type Output = LmOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> LmOutput<B> {
        self.lm_loss(batch)
    }
}

/// Burn's TUI when stdout is a terminal; otherwise [`LineRenderer`] printing every `every` steps.
pub fn renderer(every: usize) -> Option<LineRenderer> {
    (!std::io::stdout().is_terminal()).then(|| LineRenderer::new(every))
}

/// One line per `every` training steps (and one per validation pass):
/// `train epoch 1/3 items 640/16384 step 40 loss 2.3141`.
pub struct LineRenderer {
    every: usize,
    names: HashMap<MetricId, String>,
    train: Vec<(String, f64)>,
    valid: Vec<(String, f64)>,
    valid_step: Option<TrainingProgress>,
}

impl LineRenderer {
    pub fn new(every: usize) -> Self {
        Self { every: every.max(1), names: HashMap::new(), train: Vec::new(), valid: Vec::new(), valid_step: None }
    }

    fn record(names: &HashMap<MetricId, String>, values: &mut Vec<(String, f64)>, state: MetricState) {
        if let MetricState::Numeric(entry, numeric) = state {
            let name = names.get(&entry.metric_id).cloned().unwrap_or_else(|| "metric".into());
            match values.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 = numeric.current(),
                None => values.push((name, numeric.current())),
            }
        }
    }

    fn line(kind: &str, item: &TrainingProgress, values: &[(String, f64)]) -> String {
        let epoch = &item.global_progress;
        let mut line = format!("{kind} epoch {}/{}", epoch.items_processed, epoch.items_total);
        if let Some(items) = &item.progress {
            line += &format!(" items {}/{}", items.items_processed, items.items_total);
        }
        if let Some(step) = item.iteration {
            line += &format!(" step {step}");
        }
        for (name, value) in values {
            line += &format!(" {} {value:.4}", name.to_lowercase());
        }
        line
    }
}

impl MetricsRendererTraining for LineRenderer {
    fn update_train(&mut self, state: MetricState) {
        Self::record(&self.names, &mut self.train, state);
    }

    fn update_valid(&mut self, state: MetricState) {
        Self::record(&self.names, &mut self.valid, state);
    }

    fn render_train(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        if let Some(valid) = self.valid_step.take() {
            println!("{}", Self::line("valid", &valid, &self.valid));
        }
        if item.iteration.unwrap_or(0).is_multiple_of(self.every) {
            println!("{}", Self::line("train", &item, &self.train));
        }
    }

    fn render_valid(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        self.valid_step = Some(item);
    }

    fn on_train_end(&mut self, summary: Option<burn::train::LearnerSummary>) -> Result<(), Box<dyn core::error::Error>> {
        if let Some(valid) = self.valid_step.take() {
            println!("{}", Self::line("valid", &valid, &self.valid));
        }
        if let Some(summary) = summary {
            println!("{summary}");
        }
        Ok(())
    }
}

impl MetricsRendererEvaluation for LineRenderer {
    fn update_test(&mut self, _: EvaluationName, state: MetricState) {
        Self::record(&self.names, &mut self.valid, state);
    }

    fn render_test(&mut self, item: EvaluationProgress, _: Vec<ProgressType>) {
        println!("{}", Self::line("test", &TrainingProgress::from(&item), &self.valid));
    }
}

impl MetricsRenderer for LineRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Int, Tensor, TensorData};

    use super::LmBatch;
    use crate::{DecoderConfig, FloatDecoder};

    type B = Autodiff<NdArray>;

    /// `lm_loss` equals the masked mean of `cross_entropy` over the whole logits, with the head
    /// (tied or not) trained and frozen (the fused path), and so do the gradients: the final
    /// norm's (through the hidden states) and the head's when trained.
    #[test]
    fn lm_loss_equals_the_loss_over_whole_logits() {
        let device = Default::default();
        let ids = |shift: usize| (0..24).map(|i| ((i * 7 + shift) % 40) as i64).collect::<Vec<_>>();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids(0), [2, 12]), &device);
        let targets = Tensor::<B, 2, Int>::from_data(TensorData::new(ids(3), [2, 12]), &device);
        let mask = Tensor::<B, 2>::from_data(TensorData::new((0..24).map(|i| (i % 5 != 1) as u8 as f32).collect::<Vec<_>>(), [2, 12]), &device);
        for (tied, frozen) in [(true, false), (false, false), (true, true), (false, true)] {
            let mut model: FloatDecoder<B> = DecoderConfig::new(40, 16, 32, 2, 4, 2, 4).with_max_positions(16).with_tie_embeddings(tied).init(&device);
            if frozen {
                match model.lm_head.take() {
                    Some(mut head) => {
                        head.weight = head.weight.set_require_grad(false);
                        model.lm_head = Some(head);
                    }
                    None => model.embed_tokens.weight = model.embed_tokens.weight.clone().set_require_grad(false),
                }
            }
            let batch = LmBatch { inputs: tokens.clone(), targets: targets.clone(), mask: Some(mask.clone()) };
            let loss = model.lm_loss(batch).loss;
            let logits = model.forward(tokens.clone()).reshape([24, 40]);
            let m = mask.clone().reshape([24]);
            let composed = (kiln::ops::cross_entropy(logits, targets.clone().reshape([24])) * m.clone()).sum() / m.sum();
            let (a, b) = (loss.clone().into_scalar(), composed.clone().into_scalar());
            assert!((a - b).abs() < 1e-5, "tied {tied}, frozen {frozen}: lm_loss {a} vs composed {b}");
            let (gl, gc) = (loss.backward(), composed.backward());
            let norm = |g| model.norm.weight.grad(g).unwrap().into_data().to_vec::<f32>().unwrap();
            let mut pairs = vec![(norm(&gl), norm(&gc))];
            if !frozen {
                let head = |g| match &model.lm_head {
                    Some(head) => head.weight.grad(g).unwrap().into_data().to_vec::<f32>().unwrap(),
                    None => model.embed_tokens.weight.grad(g).unwrap().into_data().to_vec::<f32>().unwrap(),
                };
                pairs.push((head(&gl), head(&gc)));
            }
            for (l, c) in pairs {
                let worst = l.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
                assert!(worst < 1e-5, "tied {tied}, frozen {frozen}: gradients differ by {worst}");
            }
        }
    }
}
