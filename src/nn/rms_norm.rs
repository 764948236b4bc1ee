use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{DType, Tensor, backend::Backend};

use crate::ops::{self, rms_norm::RmsNormBackend};

/// Configuration of [`RmsNorm`].
#[derive(Config, Debug)]
pub struct RmsNormConfig {
    /// Size of the normalized (last) axis.
    pub d_model: usize,
    /// Added to the mean square before the square root.
    #[config(default = 1e-6)]
    pub epsilon: f64,
}

impl RmsNormConfig {
    /// A norm with γ = 1.
    pub fn init<B: Backend>(&self, device: &B::Device) -> RmsNorm<B> {
        RmsNorm {
            weight: Param::from_tensor(Tensor::ones([self.d_model], device)),
            epsilon: self.epsilon,
        }
    }

    /// A norm with γ = 1 in `dtype` (the forward takes x in the same dtype).
    pub fn init_with_dtype<B: Backend>(&self, device: &B::Device, dtype: DType) -> RmsNorm<B> {
        RmsNorm {
            weight: Param::from_tensor(Tensor::ones([self.d_model], (device, dtype))),
            epsilon: self.epsilon,
        }
    }
}

/// RMSNorm with a learned scale, running kiln's fused kernel. The parameter is named `weight`,
/// as in HF checkpoints.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub epsilon: f64,
}

impl<B: RmsNormBackend> RmsNorm<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        ops::rms_norm(x, self.weight.val(), self.epsilon)
    }

    /// `h = x + residual; (norm(h), h)` in one pass: the pre-norm block's residual update.
    pub fn forward_residual<const D: usize>(&self, x: Tensor<B, D>, residual: Tensor<B, D>) -> (Tensor<B, D>, Tensor<B, D>) {
        ops::rms_norm_residual(x, residual, self.weight.val(), self.epsilon)
    }
}
