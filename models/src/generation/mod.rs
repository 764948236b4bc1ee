//! Generation: one prefill of the (left-padded) prompts, then one decode step per token on the
//! preallocated KV cache, the next tokens chosen on the device ([`sampler`]). [`Generation`] is an
//! iterator of steps, so callers stream tokens as they come.

pub mod sampler;
mod stop;

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use kiln::KilnBackend;

pub use sampler::SamplingConfig;
pub use stop::StopStrings;

use crate::model::{Decoder, DecoderCache, Projection};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerationConfig {
    pub max_new_tokens: usize,
    pub sampling: SamplingConfig,
    /// Tokens that end a sequence (the model's EOS ids, chat turn ends); the stop token is
    /// reported, then nothing more for that row.
    pub stop_tokens: Vec<u32>,
    /// Padding id used left of shorter prompts (never attended to).
    pub pad_token: u32,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        Self { max_new_tokens: 64, sampling: SamplingConfig::greedy(), stop_tokens: Vec::new(), pad_token: 0 }
    }
}

/// One decode step's tokens: `Some(id)` for each row still generating, `None` for rows that
/// already stopped.
pub type StepTokens = Vec<Option<u32>>;

/// A running generation over a batch of prompts; each `next()` runs one forward pass.
pub struct Generation<'m, B: Backend, L: burn::module::Module<B>> {
    model: &'m Decoder<B, L>,
    config: GenerationConfig,
    cache: DecoderCache<B>,
    /// Left padding of each row.
    pads: Vec<usize>,
    /// The next input: the prompts before prefill, then each step's tokens.
    input: Tensor<B, 2, Int>,
    seen: Option<Tensor<B, 2>>,
    done: Vec<bool>,
    produced: usize,
}

impl<B: KilnBackend, L: Projection<B>> Decoder<B, L> {
    /// Starts generating from `prompts` (token ids, any lengths ≥ 1).
    ///
    /// # Panics
    /// On an empty batch or prompt, a sampling setting out of range, or prompts plus
    /// `max_new_tokens` beyond the model's positions.
    pub fn generate(&self, prompts: &[Vec<u32>], config: GenerationConfig) -> Generation<'_, B, L> {
        assert!(!prompts.is_empty() && prompts.iter().all(|p| !p.is_empty()), "kiln-models generate: every prompt needs a token");
        if let Err(message) = config.sampling.validate() {
            panic!("kiln-models generate: {message}");
        }
        let device = self.embed_tokens.weight.device();
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = longest + config.max_new_tokens;
        let pads: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
        let ids: Vec<i64> = prompts
            .iter()
            .zip(&pads)
            .flat_map(|(p, &pad)| std::iter::repeat_n(config.pad_token, pad).chain(p.iter().copied()).map(i64::from))
            .collect();
        let input = Tensor::from_data(TensorData::new(ids, [prompts.len(), longest]), &device);
        let vocab = self.config.vocab_size;
        let out_of_range = prompts.iter().flatten().find(|&&t| t as usize >= vocab);
        assert!(out_of_range.is_none(), "kiln-models generate: prompt token {out_of_range:?} is outside the vocabulary of {vocab}");
        let seen = config.sampling.repetition_penalty.map(|_| {
            let mut seen = vec![0f32; prompts.len() * vocab];
            for (row, prompt) in prompts.iter().enumerate() {
                for &token in prompt {
                    seen[row * vocab + token as usize] = 1.0;
                }
            }
            Tensor::from_data(TensorData::new(seen, [prompts.len(), vocab]), &device)
        });
        B::seed(&device, config.sampling.seed);
        Generation {
            model: self,
            cache: self.new_cache(prompts.len(), capacity),
            pads,
            input,
            seen,
            done: vec![false; prompts.len()],
            produced: 0,
            config,
        }
    }
}

impl<B: KilnBackend, L: Projection<B>> Generation<'_, B, L> {
    /// The KV cache (positions so far: `cache().len()`).
    pub fn cache(&self) -> &DecoderCache<B> {
        &self.cache
    }
}

impl<B: KilnBackend, L: Projection<B>> Iterator for Generation<'_, B, L> {
    type Item = StepTokens;

    fn next(&mut self) -> Option<StepTokens> {
        if self.produced >= self.config.max_new_tokens || self.done.iter().all(|&d| d) {
            return None;
        }
        let hidden = self.model.hidden(self.input.clone(), Some(&mut self.cache), &self.pads);
        let logits = self.model.last_logits(hidden);
        let tokens = sampler::sample(logits, &self.config.sampling, self.seen.as_ref());
        if let Some(seen) = self.seen.take() {
            self.seen = Some(sampler::mark_seen(seen, tokens.clone()));
        }
        let batch = self.done.len();
        self.input = tokens.clone().reshape([batch, 1]);
        self.produced += 1;
        let ids = tokens.into_data().convert::<i64>().to_vec::<i64>().expect("token ids read back as integers");
        let step = ids
            .iter()
            .zip(self.done.iter_mut())
            .map(|(&id, done)| {
                if *done {
                    return None;
                }
                let id = id as u32;
                *done = self.config.stop_tokens.contains(&id);
                Some(id)
            })
            .collect();
        Some(step)
    }
}

/// Runs a generation to the end and returns each row's tokens (stop token included).
pub fn collect_tokens(steps: impl Iterator<Item = StepTokens>, batch: usize) -> Vec<Vec<u32>> {
    let mut rows = vec![Vec::new(); batch];
    for step in steps {
        for (row, id) in rows.iter_mut().zip(step) {
            row.extend(id);
        }
    }
    rows
}
