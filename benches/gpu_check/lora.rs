//! LoRA on the H100: parity of the op (forward, every gradient, dropout) in f32/bf16 through
//! cuBLASLt, and a LoRA / QLoRA layer's training step (forward + backward) next to its base alone;
//! PEFT runs the same steps in `peers/lora.py` in the same call.

use burn::backend::{Autodiff, cuda::CudaDevice};
use burn::module::Param;
use burn::tensor::{DType, Distribution, Tensor};
use kiln::nn::{Linear, LinearLayer, LoraAdapter, LoraConfig, LoraLinear, Nf4Linear};
use kiln::ops::nf4::QuantType;

use super::common::adapters::LoraCase;
use super::B;

pub(super) type Ad = Autodiff<B>;

/// `(d_in, d_out)` of the Llama-7B projections the steps run at.
pub(super) const STEPS: [(usize, usize); 2] = [(4096, 4096), (4096, 11008)];
pub(super) const TOKENS: usize = 4096;
pub(super) const RANK: usize = 16;

pub fn parity_cases() -> Vec<LoraCase> {
    let case = |batch, m, d_in, d_out, rank, dropout, seed| LoraCase { batch, m, d_in, d_out, rank, scale: 2.0, dropout, seed };
    vec![
        case(1, 1, 4096, 4096, 16, 0.0, 1),
        case(2, 33, 1000, 257, 8, 0.1, 2),
        case(1, 512, 4096, 1024, 64, 0.0, 3),
        case(3, 17, 520, 96, 1, 0.25, 4),
        case(1, 2048, 1024, 1024, 16, 0.05, 5),
    ]
}

pub(super) fn bf16(shape: [usize; 2], std: f64, device: &CudaDevice) -> Tensor<Ad, 2> {
    Tensor::<Ad, 2>::random(shape, Distribution::Normal(0.0, std), device).cast(DType::BF16)
}

/// A bf16 adapter with random `A` and `B` (a trained adapter's work; `B = 0` changes no cost).
pub(super) fn adapter(d_in: usize, d_out: usize, dropout: f64, device: &CudaDevice) -> LoraAdapter<Ad> {
    let config = LoraConfig::new().with_rank(RANK).with_alpha(2.0 * RANK as f64).with_dropout(dropout);
    LoraAdapter::new(bf16([RANK, d_in], 0.02, device), bf16([d_out, RANK], 0.02, device), &config)
}

/// One training step of `layer` on `x`: forward, backward from `dy` through `(y · dy).sum()`;
/// returns `x`'s gradient.
fn train_step<L: LinearLayer<Ad>>(layer: &L, x: &Tensor<Ad, 2>, dy: &Tensor<Ad, 2>) -> Tensor<B, 2> {
    let grads = (layer.forward(x.clone()) * dy.clone()).sum().backward();
    x.grad(&grads).unwrap()
}

/// The loss ops alone, as a step wraps them: `(y · dy).sum()` and its backward to `y` (which
/// requires a gradient); returns `y`'s gradient.
pub(super) fn loss_step(y: &Tensor<Ad, 2>, dy: &Tensor<Ad, 2>) -> Tensor<B, 2> {
    let grads = (y.clone() * dy.clone()).sum().backward();
    y.grad(&grads).unwrap()
}

/// Seconds per [`train_step`] of `layer` on `x`.
pub(super) fn step<L: LinearLayer<Ad>>(layer: &L, x: &Tensor<Ad, 2>, dy: &Tensor<Ad, 2>, device: &CudaDevice) -> f64 {
    super::time_adaptive(device, 0.3, 100, || train_step(layer, x, dy))
}

/// A LoRA layer's step (bf16 base `Linear`, rank 16, with and without dropout 0.1) and a QLoRA
/// layer's (NF4 base), each next to its base alone, 4096 tokens; the loss ops' own time beside.
pub fn bench_steps(device: &CudaDevice) {
    for (d_in, d_out) in STEPS {
        let x = bf16([TOKENS, d_in], 1.0, device).require_grad();
        let dy = bf16([TOKENS, d_out], 1.0, device);
        let weight = bf16([d_in, d_out], 0.02, device);
        let linear = Linear { weight: Param::from_tensor(weight), bias: None };
        let nf4 = Nf4Linear::from_linear(&linear, QuantType::Nf4, 64, true);
        let y = dy.clone().require_grad();
        let loss_only = super::time_adaptive(device, 0.3, 100, || loss_step(&y, &dy));
        let base = step(&LoraLinear::frozen(linear.clone()), &x, &dy, device);
        let lora = step(&LoraLinear::frozen(linear.clone()).with_adapter(adapter(d_in, d_out, 0.0, device)), &x, &dy, device);
        let lora_dropout = step(&LoraLinear::frozen(linear.clone()).with_adapter(adapter(d_in, d_out, 0.1, device)), &x, &dy, device);
        let qbase = step(&LoraLinear::frozen(nf4.clone()), &x, &dy, device);
        let qlora = step(&LoraLinear::frozen(nf4).with_adapter(adapter(d_in, d_out, 0.0, device)), &x, &dy, device);
        let ms = |t: f64| t * 1e3;
        println!(
            "bench lora step t{TOKENS} k{d_in} n{d_out} r{RANK} bf16: kiln base {:.3} ms, lora {:.3} ms (+{:.3}), lora+dropout0.1 {:.3} ms | nf4 base {:.3} ms, qlora {:.3} ms (+{:.3}) | loss ops {:.3} ms of each",
            ms(base),
            ms(lora),
            ms(lora - base),
            ms(lora_dropout),
            ms(qbase),
            ms(qlora),
            ms(qlora - qbase),
            ms(loss_only)
        );
    }
}

/// `rounds` LoRA steps at 4096 → 4096 (4096 tokens, rank 16, bf16), each synchronized, after the
/// base alone as many times: for a profiler or `cuda_trace.so` to split a step's time by kernel.
pub fn step_trace(device: &CudaDevice, rounds: usize) {
    let (x, dy) = (bf16([TOKENS, 4096], 1.0, device).require_grad(), bf16([TOKENS, 4096], 1.0, device));
    let linear = Linear { weight: Param::from_tensor(bf16([4096, 4096], 0.02, device)), bias: None };
    let base = LoraLinear::frozen(linear.clone());
    let lora = LoraLinear::frozen(linear).with_adapter(adapter(4096, 4096, 0.0, device));
    for (name, layer) in [("base", &base), ("lora", &lora)] {
        for _ in 0..3 {
            drop(train_step(layer, &x, &dy));
        }
        super::sync_all(device);
        let start = std::time::Instant::now();
        for _ in 0..rounds {
            drop(train_step(layer, &x, &dy));
            super::sync_all(device);
        }
        println!("bench lora trace {name} t{TOKENS} 4096 -> 4096: {:.3} ms a synchronized step over {rounds}", start.elapsed().as_secs_f64() * 1e3 / rounds as f64);
    }
}
