//! The cos/sin tables of RoPE, computed once on the host in f64 and kept on the device in f32.

use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};

/// Frequency scaling applied to the base inverse frequencies.
#[derive(Debug, Clone, Copy, PartialEq, burn::serde::Serialize, burn::serde::Deserialize)]
#[serde(crate = "burn::serde")]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Linear position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_positions: usize,
    },
}

impl RopeScaling {
    /// The inverse frequencies of the `head_dim / 2` rotated pairs with base `theta`, scaled.
    pub fn inv_freq(&self, head_dim: usize, theta: f64) -> Vec<f64> {
        (0..head_dim / 2).map(|i| self.apply(1.0 / theta.powf(2.0 * i as f64 / head_dim as f64))).collect()
    }

    fn apply(&self, inv_freq: f64) -> f64 {
        match *self {
            RopeScaling::None => inv_freq,
            RopeScaling::Linear { factor } => inv_freq / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => {
                let old = original_max_positions as f64;
                let wavelen = 2.0 * core::f64::consts::PI / inv_freq;
                if wavelen < old / high_freq_factor {
                    inv_freq
                } else if wavelen > old / low_freq_factor {
                    inv_freq / factor
                } else {
                    let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
                }
            }
        }
    }
}

/// `cos`/`sin` of `position · inv_freq[i]` for `positions × head_dim/2` angles, f32 on the device.
/// A module of constants: it sits inside a model, follows it across devices, and is never trained
/// or saved.
#[derive(burn::module::Module, Debug)]
pub struct RopeTable<B: Backend> {
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
}

impl<B: Backend> RopeTable<B> {
    /// Tables for heads of `head_dim` (even) and positions `0..max_positions`, with base `theta`.
    ///
    /// # Panics
    /// If `head_dim` is odd or zero.
    pub fn new(head_dim: usize, max_positions: usize, theta: f64, scaling: RopeScaling, device: &B::Device) -> Self {
        crate::error::ensure(head_dim > 0 && head_dim % 2 == 0, "RopeTable", || {
            format!("head_dim must be even and positive, got {head_dim}")
        });
        Self::from_inv_freq(&scaling.inv_freq(head_dim, theta), max_positions, device)
    }

    /// Tables for explicit inverse frequencies, one per rotated pair (`head_dim / 2` of them):
    /// for frequencies a checkpoint stores, e.g. GGUF's per-frequency divisors.
    ///
    /// # Panics
    /// If `inv_freq` is empty.
    pub fn from_inv_freq(inv_freq: &[f64], max_positions: usize, device: &B::Device) -> Self {
        crate::error::ensure(!inv_freq.is_empty(), "RopeTable", || "no frequencies given".to_string());
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in inv_freq {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        let upload = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [max_positions, half]), (device, DType::F32));
        Self {
            cos: upload(cos),
            sin: upload(sin),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.cos.dims()[1] * 2
    }

    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The table of `positions` only (`[n]` indices, row `i` of the result holding position
    /// `positions[i]`): rotate with it at offset 0 when the positions live on the device, as in a
    /// decode step replayed from a CUDA graph, where a host offset would be frozen into the graph.
    pub fn rows(&self, positions: Tensor<B, 1, Int>) -> Self {
        Self { cos: self.cos.clone().select(0, positions.clone()), sin: self.sin.clone().select(0, positions) }
    }

    /// `[positions, head_dim/2]` f32.
    pub fn cos(&self) -> Tensor<B, 2> {
        self.cos.clone()
    }

    /// `[positions, head_dim/2]` f32.
    pub fn sin(&self) -> Tensor<B, 2> {
        self.sin.clone()
    }
}
