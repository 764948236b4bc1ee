use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};

use super::{Linear, LinearConfig};
use crate::ops::matmul::MatmulBackend;
use crate::ops::swiglu::{GluActivation, SwiGluBackend, glu};

/// Configuration of [`GatedMlp`].
#[derive(Config, Debug)]
pub struct GatedMlpConfig {
    pub d_model: usize,
    pub d_ff: usize,
    /// `Silu` gives the Llama/Qwen SwiGLU MLP, `GeluTanh` the Gemma GeGLU MLP, `Relu2` BitNet's.
    #[config(default = "GluActivation::Silu")]
    pub activation: GluActivation,
}

impl GatedMlpConfig {
    pub fn init<B: Backend>(&self, device: &B::Device) -> GatedMlp<B> {
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        GatedMlp {
            gate: linear(self.d_model, self.d_ff),
            up: linear(self.d_model, self.d_ff),
            down: linear(self.d_ff, self.d_model),
            activation: self.activation,
        }
    }
}

/// `down(act(gate(x)) · up(x))` with the gating fused in one kernel (forward and backward).
#[derive(Module, Debug)]
pub struct GatedMlp<B: Backend> {
    pub gate: Linear<B>,
    pub up: Linear<B>,
    pub down: Linear<B>,
    #[module(skip)]
    pub activation: GluActivation,
}

impl<B: SwiGluBackend + MatmulBackend> GatedMlp<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let (g, u) = (self.gate.forward(x.clone()), self.up.forward(x));
        self.down.forward(glu(g, u, self.activation))
    }
}
