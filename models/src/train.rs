//! Training a decoder with Burn's `Learner`: next-token batches, the loss (optionally on masked
//! positions only, e.g. the response of an instruction pair), `TrainStep`/`InferenceStep` for
//! [`Decoder`], and a compact progress renderer for runs without a terminal (Burn's TUI draws
//! when one is attached).

use std::collections::HashMap;
use std::io::IsTerminal;

use burn::module::{AutodiffModule, ModuleDisplay};
use burn::tensor::{FloatDType, Int, Tensor, backend::{AutodiffBackend, Backend}};
use burn::train::metric::{MetricDefinition, MetricId};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation, MetricsRendererTraining, ProgressType,
    TrainingProgress,
};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use kiln::KilnBackend;

use crate::model::{Decoder, Projection};

/// Inputs and next-token targets `[batch, seq]`; `mask` (1 = counted) limits the loss to some
/// positions.
#[derive(Debug, Clone)]
pub struct LmBatch<B: Backend> {
    pub inputs: Tensor<B, 2, Int>,
    pub targets: Tensor<B, 2, Int>,
    pub mask: Option<Tensor<B, 2>>,
}

impl<B: KilnBackend, L: Projection<B>> Decoder<B, L> {
    /// Mean cross-entropy of the next-token predictions (over masked positions when a mask is
    /// given), computed in f32 by kiln's fused `cross_entropy` (no f32 copy of the logits), with
    /// the logits and targets flattened for Burn's metrics.
    pub fn lm_loss(&self, batch: LmBatch<B>) -> ClassificationOutput<B> {
        let logits = self.forward(batch.inputs);
        let [b, s, v] = logits.dims();
        let logits = logits.reshape([b * s, v]);
        let targets = batch.targets.reshape([b * s]);
        let losses = kiln::ops::cross_entropy(logits.clone(), targets.clone());
        let loss = match batch.mask {
            Some(mask) => {
                let mask = mask.reshape([b * s]).cast(FloatDType::from(losses.dtype()));
                let count = mask.clone().sum().clamp_min(1.0);
                (losses * mask).sum() / count
            }
            None => losses.mean(),
        };
        ClassificationOutput::new(loss, logits, targets)
    }
}

impl<B, L> TrainStep for Decoder<B, L>
where
    B: KilnBackend + AutodiffBackend,
    L: Projection<B> + AutodiffModule<B> + ModuleDisplay,
    L::InnerModule: ModuleDisplay,
{
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.lm_loss(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: KilnBackend, L: Projection<B>> InferenceStep for Decoder<B, L> {
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> ClassificationOutput<B> {
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
