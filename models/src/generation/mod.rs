//! Generation: one prefill of the (left-padded) prompts, then one decode step per token on the
//! preallocated KV cache, the next tokens chosen on the device ([`sampler`]). [`Generation`] is an
//! iterator of steps, so callers stream tokens as they come. Greedy decoding on Burn's `Cuda`
//! backend replays its steps from a CUDA graph once they are warm (`graph`).

#[cfg(feature = "cuda")]
mod graph;
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
    /// Greedy decoding (temperature 0, no repetition penalty) on Burn's `Cuda` backend captures a
    /// decode step as a CUDA graph after a few plain steps and replays it for the rest, which
    /// removes the host cost of the step's ~20 kernel launches a layer. While a generation
    /// replays, run nothing else on its device between its steps: the step's intermediate buffers
    /// stay in CubeCL's memory pool, and other work could be handed them. Other backends and
    /// samplers ignore it.
    pub cuda_graph: bool,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        Self { max_new_tokens: 64, sampling: SamplingConfig::greedy(), stop_tokens: Vec::new(), pad_token: 0, cuda_graph: true }
    }
}

/// How a generation's decode steps run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepPath {
    /// Through Burn, op by op.
    Plain,
    /// Plain until the graph is captured.
    GraphPending,
    /// Replayed from CUDA graphs (the step's `parts`) of `kernels` kernel nodes and `uploads`
    /// host-to-device copies in all.
    Graph { kernels: usize, parts: usize, uploads: usize },
    /// The capture failed (the reason); the steps stay plain.
    GraphFailed(String),
}

/// Plain decode steps before the capture: the first runs compile kernels and settle the fusion
/// plans, which a capture cannot do.
#[cfg(feature = "cuda")]
const PLAIN_STEPS: usize = 2;
/// Steps left under which a capture does not pay.
#[cfg(feature = "cuda")]
const MIN_REPLAYS: usize = 4;

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
    /// Last step's tokens, the graph's next input.
    last: Vec<i64>,
    path: StepPath,
    #[cfg(feature = "cuda")]
    graph: Option<graph::GraphStep<B>>,
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
        let greedy = config.sampling.temperature == 0.0 && config.sampling.repetition_penalty.is_none();
        let path = if config.cuda_graph && greedy && cfg!(feature = "cuda") { StepPath::GraphPending } else { StepPath::Plain };
        Generation {
            model: self,
            cache: self.new_cache(prompts.len(), capacity),
            pads,
            input,
            seen,
            done: vec![false; prompts.len()],
            produced: 0,
            last: Vec::new(),
            path,
            #[cfg(feature = "cuda")]
            graph: None,
            config,
        }
    }
}

impl<B: KilnBackend, L: Projection<B>> Generation<'_, B, L> {
    /// The KV cache (positions so far: `cache().len()`).
    pub fn cache(&self) -> &DecoderCache<B> {
        &self.cache
    }

    /// How the decode steps run so far.
    pub fn step_path(&self) -> &StepPath {
        &self.path
    }

    /// One forward pass; returns each row's next token.
    fn step(&mut self) -> Vec<i64> {
        #[cfg(feature = "cuda")]
        if let Some(ids) = self.graph_step() {
            return ids;
        }
        let hidden = self.model.hidden(self.input.clone(), Some(&mut self.cache), &self.pads);
        let logits = self.model.last_logits(hidden);
        let tokens = sampler::sample(logits, &self.config.sampling, self.seen.as_ref());
        if let Some(seen) = self.seen.take() {
            self.seen = Some(sampler::mark_seen(seen, tokens.clone()));
        }
        let batch = self.done.len();
        self.input = tokens.clone().reshape([batch, 1]);
        tokens.into_data().convert::<i64>().to_vec::<i64>().expect("token ids read back as integers")
    }

    /// The step replayed from the graph, captured first when it is time; `None`: a plain step.
    ///
    /// # Panics
    /// If a replay fails (the device's state is then unknown).
    #[cfg(feature = "cuda")]
    fn graph_step(&mut self) -> Option<Vec<i64>> {
        let due = self.produced >= 1 + PLAIN_STEPS && self.config.max_new_tokens - self.produced >= MIN_REPLAYS;
        if self.path == StepPath::GraphPending && due {
            self.path = match graph::capture(self.model, &mut self.cache, &self.pads, &self.config.sampling) {
                None => StepPath::Plain,
                Some(Ok(step)) => {
                    let nodes = step.nodes();
                    self.graph = Some(step);
                    StepPath::Graph { kernels: nodes.kernels, parts: nodes.graphs, uploads: nodes.uploads }
                }
                Some(Err(reason)) => {
                    eprintln!("kiln-models: decoding without a CUDA graph: {reason}");
                    StepPath::GraphFailed(reason)
                }
            };
        }
        let graph = self.graph.as_mut()?;
        let position = self.cache.len();
        self.cache.advance(1);
        Some(graph.run(&self.last, position).unwrap_or_else(|e| panic!("kiln-models generate: a CUDA graph replay failed: {e}")))
    }
}

impl<B: KilnBackend, L: Projection<B>> Iterator for Generation<'_, B, L> {
    type Item = StepTokens;

    fn next(&mut self) -> Option<StepTokens> {
        if self.produced >= self.config.max_new_tokens || self.done.iter().all(|&d| d) {
            return None;
        }
        let ids = self.step();
        self.produced += 1;
        self.last.clone_from(&ids);
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
