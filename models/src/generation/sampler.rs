//! Next-token choice on the device: repetition penalty, temperature, top-k, top-p, min-p, then
//! greedy argmax or a Gumbel-max draw (argmax of `logit/T + Gumbel noise` samples the softmax
//! exactly, with no sort or cumulative sum over the vocabulary). Only the chosen ids leave the
//! device.

use burn::tensor::{Distribution, FloatDType, Int, Tensor, backend::Backend};

/// How to pick each next token. `temperature == 0` is greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    pub temperature: f64,
    /// Keep the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`.
    pub top_p: Option<f64>,
    /// Keep tokens at least `min_p` times as likely as the most likely one.
    pub min_p: Option<f64>,
    /// CTRL's penalty on tokens already in the sequence (prompt included): positive logits are
    /// divided by it, negative ones multiplied, as transformers does.
    pub repetition_penalty: Option<f64>,
    /// Seeds the backend's random generator when generation starts.
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingConfig {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: None, top_p: None, min_p: None, repetition_penalty: None, seed: 0 }
    }

    /// Checks the ranges; the message names the setting.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature {} must be finite and ≥ 0", self.temperature));
        }
        if self.top_k == Some(0) {
            return Err("top_k must be at least 1".into());
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(format!("top_p {p} must be in (0, 1]"));
        }
        if let Some(p) = self.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return Err(format!("min_p {p} must be in [0, 1]"));
        }
        if let Some(r) = self.repetition_penalty.filter(|r| !(r.is_finite() && *r > 0.0)) {
            return Err(format!("repetition_penalty {r} must be positive"));
        }
        Ok(())
    }
}

/// Bisection steps of the top-p threshold: the kept set is exact up to probabilities closer than
/// `range / 2^steps` in logit space.
const TOP_P_STEPS: usize = 30;

/// Chooses one token per row of `logits` (`[batch, vocab]`). `seen` (`[batch, vocab]`, 1 where the
/// token occurred) drives the repetition penalty.
pub fn sample<B: Backend>(logits: Tensor<B, 2>, config: &SamplingConfig, seen: Option<&Tensor<B, 2>>) -> Tensor<B, 1, Int> {
    let mut logits = logits.cast(FloatDType::F32);
    if let (Some(penalty), Some(seen)) = (config.repetition_penalty, seen) {
        let penalized = logits.clone().greater_elem(0.0);
        let scaled = logits.clone().div_scalar(penalty).mask_where(penalized.bool_not(), logits.clone().mul_scalar(penalty));
        logits = logits.mask_where(seen.clone().greater_elem(0.0), scaled);
    }
    let [batch, vocab] = logits.dims();
    if config.temperature == 0.0 {
        return logits.argmax(1).reshape([batch]);
    }
    let mut logits = logits.div_scalar(config.temperature);
    if let Some(k) = config.top_k.filter(|&k| k < vocab) {
        let kth = logits.clone().topk(k, 1).narrow(1, k - 1, 1);
        logits = logits.clone().mask_fill(logits.lower(kth), f32::NEG_INFINITY);
    }
    if let Some(min_p) = config.min_p.filter(|&p| p > 0.0) {
        // p_i ≥ min_p · p_max  ⇔  logit_i ≥ logit_max + ln(min_p)
        let floor = logits.clone().max_dim(1).add_scalar(min_p.ln());
        logits = logits.clone().mask_fill(logits.lower(floor), f32::NEG_INFINITY);
    }
    if let Some(top_p) = config.top_p.filter(|&p| p < 1.0) {
        let threshold = top_p_threshold(logits.clone(), top_p);
        logits = logits.clone().mask_fill(logits.lower(threshold), f32::NEG_INFINITY);
    }
    let uniform = Tensor::<B, 2>::random([batch, vocab], Distribution::Uniform(0.0, 1.0), &logits.device()).clamp(1e-12, 1.0 - 1e-7);
    let gumbel = uniform.log().neg().log().neg();
    (logits + gumbel).argmax(1).reshape([batch])
}

/// Per row, the largest logit `t` such that the tokens with logit ≥ `t` hold probability ≥ `p`
/// (the top-p set), found by bisection between the row's smallest finite logit and its largest.
fn top_p_threshold<B: Backend>(logits: Tensor<B, 2>, p: f64) -> Tensor<B, 2> {
    let probs = burn::tensor::activation::softmax(logits.clone(), 1);
    let max = logits.clone().max_dim(1);
    let finite = logits.clone().is_finite();
    let mut lo = logits.clone().mask_fill(finite.bool_not(), f32::INFINITY).min_dim(1);
    let mut hi = max;
    // Invariant: the set {logit ≥ lo} holds ≥ p; {logit ≥ hi} may not.
    for _ in 0..TOP_P_STEPS {
        let mid = (lo.clone() + hi.clone()).div_scalar(2.0);
        let mass = probs.clone().mask_fill(logits.clone().lower(mid.clone()), 0.0).sum_dim(1);
        let enough = mass.greater_equal_elem(p);
        lo = lo.mask_where(enough.clone(), mid.clone());
        hi = hi.mask_where(enough.bool_not(), mid);
    }
    lo
}

/// Marks `tokens` (`[batch]`) in `seen` (`[batch, vocab]`).
pub fn mark_seen<B: Backend>(seen: Tensor<B, 2>, tokens: Tensor<B, 1, Int>) -> Tensor<B, 2> {
    let vocab = seen.dims()[1];
    seen.max_pair(tokens.one_hot::<2>(vocab).float())
}
