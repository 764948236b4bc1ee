//! Cases of the adapter ops: LoRA's update, a LoRA layer over a float base in one op, DoRA's
//! rescaling, and a whole DoRA layer against PEFT's dense formula.

use burn::module::Param;
use burn::tensor::{DType, Tensor, TensorData};
use kiln::KilnAutodiffBackend;
use kiln::nn::{Linear, LoraAdapter, LoraConfig, LoraLinear};
use kiln::ops::nf4::{Packed4, QuantType, Quantized4};
use kiln::ops::{self, lora::DropoutMask};

use super::checks::{Case, grad, prim, weighted, wrap};
use super::{random, tensor, values};

type Outputs = Vec<(&'static str, Vec<f64>)>;

/// `x` times the dropout factors of `mask` (0 or `1 / (1 − p)`), built on the host.
fn dropped<B: KilnAutodiffBackend>(x: Tensor<B, 3>, mask: DropoutMask) -> Tensor<B, 3> {
    let dims = x.dims();
    let factors: Vec<f64> = (0..dims.iter().product::<usize>()).map(|i| if mask.keeps(i as u32) { mask.scale as f64 } else { 0.0 }).collect();
    let factors = tensor::<B, 3>(&TensorData::new(factors, dims), x.dtype(), &x.device());
    x * factors
}

/// `y = base + s · dropout(x) · Aᵀ · Bᵀ` on `x [batch, m, d_in]`, a random `base [batch, m,
/// d_out]`, `A [r, d_in]`, `B [out, r]`, with every gradient (`x` also feeds a second consumer);
/// the reference is the formula in plain Burn ops with the dropout mask built on the host from
/// the same hash.
#[derive(Debug, Clone, Copy)]
pub struct LoraCase {
    pub batch: usize,
    pub m: usize,
    pub d_in: usize,
    pub d_out: usize,
    pub rank: usize,
    pub scale: f32,
    /// Drop probability (0: no dropout).
    pub dropout: f64,
    pub seed: u64,
}

impl LoraCase {
    fn mask(&self) -> Option<ops::lora::DropoutMask> {
        (self.dropout > 0.0).then(|| ops::lora::DropoutMask::new(self.dropout, self.seed))
    }
}

impl Case for LoraCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let (b, m, s) = (self.batch, self.m, self.seed);
        let x = tensor::<B, 3>(&random(&[b, m, self.d_in], s), dtype, device).require_grad();
        let base = tensor::<B, 3>(&random(&[b, m, self.d_out], s + 1), dtype, device).require_grad();
        let a = tensor::<B, 2>(&random(&[self.rank, self.d_in], s + 2), dtype, device).require_grad();
        let bw = tensor::<B, 2>(&random(&[self.d_out, self.rank], s + 3), dtype, device).require_grad();
        let y = if kernel {
            let spec = ops::lora::LoraSpec { scale: self.scale, dropout: self.mask() };
            ops::lora(x.clone(), base.clone(), a.clone(), bw.clone(), spec)
        } else {
            let dropped = match self.mask() {
                Some(mask) => dropped(x.clone(), mask),
                None => x.clone(),
            };
            let h = dropped.matmul(a.clone().transpose().unsqueeze());
            base.clone() + h.matmul(bw.clone().transpose().unsqueeze()) * self.scale
        };
        // A second consumer of `x`, deeper in the graph, registers its gradient first: the op's
        // backward takes it into its `dx` product.
        let side = (x.clone() * 0.5).tanh() * 2.0;
        let grads = (weighted(y.clone(), s + 4, device) + weighted(side, s + 5, device)).backward();
        vec![
            ("y", values(y)),
            ("dx", grad(&x, &grads)),
            ("dbase", grad(&base, &grads)),
            ("da", grad(&a, &grads)),
            ("db", grad(&bw, &grads)),
        ]
    }

    fn depth(&self) -> f64 {
        self.d_in.max(self.d_out).max(self.batch * self.m) as f64
    }

    fn footprint(&self) -> usize {
        self.batch * self.m * (self.d_in + self.d_out + self.rank) + self.rank * (self.d_in + self.d_out)
    }
}

/// `y = x · W + b + s · dropout(x) · Aᵀ · Bᵀ` ([`ops::lora::lora_linear`]) on `x [batch, m,
/// d_in]` with Burn's `W [d_in, d_out]` (built as it is stored, or as the transposed view of an
/// `[d_out, in]` tensor, as a checkpoint's weight may be), an optional bias, `A [r, d_in]`, `B
/// [out, r]`; the gradients of `x` (where `x` is tracked; with `prior` a second consumer registers
/// its share first), `A`, `B`, and of `W` and the bias where the base trains. The reference is the
/// formula in plain Burn ops.
#[derive(Debug, Clone, Copy)]
pub struct LoraLinearCase {
    pub batch: usize,
    pub m: usize,
    pub d_in: usize,
    pub d_out: usize,
    pub rank: usize,
    pub scale: f32,
    pub dropout: f64,
    pub bias: bool,
    /// `W` stored `[d_out, d_in]` and viewed transposed.
    pub transposed: bool,
    /// `x` tracked (its gradient asked for).
    pub x_grad: bool,
    /// A second consumer of a tracked `x` whose gradient is registered first.
    pub prior: bool,
    /// `W` and the bias tracked: a base that trains (a 4-bit `W` is frozen: its bias alone).
    pub base_grad: bool,
    /// `W` 4-bit (`[d_out, d_in]`, blocks of 64; NF4 with double quantization, FP4 without),
    /// through `lora_linear_4bit`.
    pub packed: Option<QuantType>,
    pub seed: u64,
}

impl LoraLinearCase {
    /// `batch × m` rows, `d_in → d_out`, rank `rank`, scale 2: `x` and the adapter tracked, no
    /// dropout, bias, prior, transposed or trained base (set those by struct update).
    pub fn new(batch: usize, m: usize, d_in: usize, d_out: usize, rank: usize, seed: u64) -> Self {
        Self { batch, m, d_in, d_out, rank, scale: 2.0, dropout: 0.0, bias: false, transposed: false, x_grad: true, prior: false, base_grad: false, packed: None, seed }
    }
}

impl Case for LoraLinearCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let (b, m, s, (d_in, d_out)) = (self.batch, self.m, self.seed, (self.d_in, self.d_out));
        let track = |t: Tensor<B, 2>, on: bool| if on { t.require_grad() } else { t };
        let x = tensor::<B, 3>(&random(&[b, m, d_in], s), dtype, device);
        let x = if self.x_grad { x.require_grad() } else { x };
        // `N(0, 1 / d_in)`, scaled on the host: a scalar op would make the stored tensor dense.
        let stored = if self.transposed || self.packed.is_some() { [d_out, d_in] } else { [d_in, d_out] };
        let values_w: Vec<f64> = random(&stored, s + 1).to_vec::<f64>().unwrap().iter().map(|v| v / (d_in as f64).sqrt()).collect();
        // A 4-bit weight is quantized once on the host, so every run (and the f64 oracle) holds the
        // same codes; the reference multiplies it dequantized in the run's dtype.
        let packed = self.packed.map(|kind| {
            let values: Vec<f32> = values_w.iter().map(|&v| v as f32).collect();
            let packed = Packed4::quantize(&values, &stored, kind, 64, kind == QuantType::Nf4).unwrap();
            Quantized4::<B>::from_host(&packed, device).unwrap()
        });
        let w = match &packed {
            Some(packed) => packed.dequantize(dtype).transpose(),
            None => {
                let w = tensor::<B, 2>(&TensorData::new(values_w, stored), dtype, device);
                track(if self.transposed { w.transpose() } else { w }, self.base_grad)
            }
        };
        let bias = self.bias.then(|| {
            let bias = tensor::<B, 1>(&random(&[d_out], s + 2), dtype, device);
            if self.base_grad { bias.require_grad() } else { bias }
        });
        let a = tensor::<B, 2>(&random(&[self.rank, d_in], s + 3), dtype, device).require_grad();
        let bw = tensor::<B, 2>(&random(&[d_out, self.rank], s + 4), dtype, device).require_grad();
        let mask = (self.dropout > 0.0).then(|| DropoutMask::new(self.dropout, s));
        let y = if kernel {
            let spec = ops::lora::LoraSpec { scale: self.scale, dropout: mask };
            match &packed {
                Some(packed) => ops::lora::lora_linear_4bit(x.clone(), packed, bias.clone(), a.clone(), bw.clone(), spec),
                None => ops::lora::lora_linear(x.clone(), w.clone(), bias.clone(), a.clone(), bw.clone(), spec),
            }
        } else {
            let dropped = match mask {
                Some(mask) => dropped(x.clone(), mask),
                None => x.clone(),
            };
            let update = dropped.matmul(a.clone().transpose().unsqueeze()).matmul(bw.clone().transpose().unsqueeze()) * self.scale;
            let base = x.clone().matmul(w.clone().unsqueeze());
            match &bias {
                Some(bias) => base + bias.clone().unsqueeze::<3>() + update,
                None => base + update,
            }
        };
        let loss = weighted(y.clone(), s + 5, device);
        let loss = if self.x_grad && self.prior { loss + weighted((x.clone() * 0.5).tanh() * 2.0, s + 6, device) } else { loss };
        let grads = loss.backward();
        let mut outputs = vec![("y", values(y)), ("da", grad(&a, &grads)), ("db", grad(&bw, &grads))];
        if self.x_grad {
            outputs.push(("dx", grad(&x, &grads)));
        }
        if self.base_grad {
            if packed.is_none() {
                outputs.push(("dw", grad(&w, &grads)));
            }
            if let Some(bias) = &bias {
                outputs.push(("dbias", grad(bias, &grads)));
            }
        }
        outputs
    }

    fn depth(&self) -> f64 {
        self.d_in.max(self.d_out).max(self.batch * self.m) as f64
    }

    fn footprint(&self) -> usize {
        self.batch * self.m * (2 * self.d_in + 2 * self.d_out + self.rank) + self.rank * (self.d_in + self.d_out) + 2 * self.d_in * self.d_out
    }
}

/// A positive `[n]` vector (`|N(0, 1)| + 0.5`): DoRA's norms and magnitudes.
fn positive<B: KilnAutodiffBackend>(n: usize, seed: u64, dtype: DType, device: &B::Device) -> Tensor<B, 1> {
    tensor::<B, 1>(&random(&[n], seed), dtype, device).abs() + 0.5
}

/// DoRA's rescaling `y = (m / n) · (u − b) + b` on `u [batch, m, out]`, with `du` and `dm`; the
/// norm `n` is a constant, the bias (optional) a frozen one.
#[derive(Debug, Clone, Copy)]
pub struct DoraCase {
    pub batch: usize,
    pub m: usize,
    pub d_out: usize,
    pub bias: bool,
    pub seed: u64,
}

impl Case for DoraCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let s = self.seed;
        let u = tensor::<B, 3>(&random(&[self.batch, self.m, self.d_out], s), dtype, device).require_grad();
        let magnitude = positive::<B>(self.d_out, s + 1, dtype, device).require_grad();
        let norm = positive::<B>(self.d_out, s + 2, dtype, device);
        let bias = self.bias.then(|| tensor::<B, 1>(&random(&[self.d_out], s + 3), dtype, device));
        let y = if kernel {
            ops::dora(u.clone(), magnitude.clone(), norm, bias)
        } else {
            let c = (magnitude.clone() / norm).unsqueeze::<3>();
            match bias {
                Some(b) => {
                    let b = b.unsqueeze::<3>();
                    c * (u.clone() - b.clone()) + b
                }
                None => c * u.clone(),
            }
        };
        let grads = weighted(y.clone(), s + 4, device).backward();
        vec![("y", values(y)), ("du", grad(&u, &grads)), ("dm", grad(&magnitude, &grads))]
    }

    fn depth(&self) -> f64 {
        (self.batch * self.m) as f64
    }

    fn footprint(&self) -> usize {
        self.batch * self.m * self.d_out * 3
    }
}

/// DoRA's factored weight norm `‖W + s · B · A‖` per output from `‖W‖²`, `A · W` `[r, out]`, `A`
/// `[r, in]` and `B` `[out, r]` of a random `W` `[in, out]`; the reference is the factored formula
/// in plain Burn ops (`factored_norm_equals_the_dense_norm` ties that to the dense norm).
#[derive(Debug, Clone, Copy)]
pub struct DoraNormCase {
    pub d_in: usize,
    pub d_out: usize,
    pub rank: usize,
    pub scale: f64,
    pub seed: u64,
}

impl Case for DoraNormCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        // `‖W‖²` and `A · W` on the host (a product on lavapipe autotunes for minutes a shape).
        let (d_in, d_out, r, s) = (self.d_in, self.d_out, self.rank, self.seed);
        let host = |shape: [usize; 2], seed| random(&shape, seed).convert::<f64>().to_vec::<f64>().unwrap();
        let (w, a) = (host([d_in, d_out], s), host([r, d_in], s + 1));
        let w: Vec<f64> = w.iter().map(|v| v / (d_in as f64).sqrt()).collect();
        // Row by row of `W`, so the GPU check's Llama-sized cases stay seconds on the host.
        let (mut norms_sq, mut a_w) = (vec![0.0; d_out], vec![0.0; r * d_out]);
        for (i, w_row) in w.chunks(d_out).enumerate() {
            norms_sq.iter_mut().zip(w_row).for_each(|(n, v)| *n += v * v);
            for (p, out) in a_w.chunks_mut(d_out).enumerate() {
                let a_pi = a[p * d_in + i];
                out.iter_mut().zip(w_row).for_each(|(o, v)| *o += a_pi * v);
            }
        }
        let input = |values: Vec<f64>, shape: [usize; 2], dtype| tensor::<B, 2>(&TensorData::new(values, shape), dtype, device);
        let norms_sq = input(norms_sq, [1, d_out], DType::F32).squeeze_dim::<1>(0);
        let (a_w, a) = (input(a_w, [r, d_out], dtype), input(a, [r, d_in], dtype));
        let b = tensor::<B, 2>(&random(&[d_out, r], s + 2), dtype, device) * 0.5;
        let norm = if kernel {
            ops::dora_norm(norms_sq, a_w, a, b, self.scale)
        } else {
            wrap(ops::dora::reference::norm::<B>(prim(norms_sq), prim(a_w), prim(a), prim(b), self.scale))
        };
        vec![("norm", values(norm))]
    }

    fn depth(&self) -> f64 {
        self.d_in.max(self.rank) as f64
    }

    fn footprint(&self) -> usize {
        self.rank * (self.d_in + self.rank + 2 * self.d_out) + 2 * self.d_out
    }
}

/// A DoRA layer (`LoraLinear` over a float `Linear`, trained `B`, optional bias and dropout)
/// against PEFT's dense formula: `W' = W + s·B·A`, `c = m / ‖W'‖` (detached),
/// `y = x·W + b + (c − 1)·(x̃·W) + c·(x̃·ΔW)` with `x̃` the dropped-out input; gradients of `x`, `A`,
/// `B` and `m`.
#[derive(Debug, Clone, Copy)]
pub struct DoraLayerCase {
    pub batch: usize,
    pub m: usize,
    pub d_in: usize,
    pub d_out: usize,
    pub rank: usize,
    pub rslora: bool,
    pub bias: bool,
    pub dropout: f64,
    pub seed: u64,
}

impl DoraLayerCase {
    fn config(&self) -> LoraConfig {
        LoraConfig::new().with_rank(self.rank).with_alpha(2.0 * self.rank as f64).with_rslora(self.rslora).with_dropout(self.dropout).with_dora(true)
    }
}

impl Case for DoraLayerCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let (s, config) = (self.seed, self.config());
        let x = tensor::<B, 3>(&random(&[self.batch, self.m, self.d_in], s), dtype, device).require_grad();
        let w = tensor::<B, 2>(&random(&[self.d_in, self.d_out], s + 1), dtype, device) / (self.d_in as f64).sqrt();
        let bias = self.bias.then(|| tensor::<B, 1>(&random(&[self.d_out], s + 2), dtype, device));
        let a = tensor::<B, 2>(&random(&[self.rank, self.d_in], s + 3), dtype, device) / (self.d_in as f64).sqrt();
        let b = tensor::<B, 2>(&random(&[self.d_out, self.rank], s + 4), dtype, device) * 0.1;
        let magnitude = positive::<B>(self.d_out, s + 5, dtype, device);
        let mask = (self.dropout > 0.0).then(|| DropoutMask::new(self.dropout, s));
        let loss_seed = s + 6;
        if kernel {
            let base = Linear { weight: Param::from_tensor(w), bias: bias.map(Param::from_tensor) };
            let adapter = LoraAdapter::new(a, b, &config).with_magnitude(magnitude);
            let layer = LoraLinear::frozen(base).with_adapter(adapter);
            let y = layer.forward_with_dropout(x.clone(), mask);
            let grads = weighted(y.clone(), loss_seed, device).backward();
            let adapter = layer.adapter.as_ref().unwrap();
            let param_grad = |p: &Param<Tensor<B, 2>>| values(p.grad(&grads).expect("adapter gradient"));
            let dm = values(adapter.magnitude.as_ref().unwrap().grad(&grads).expect("magnitude gradient"));
            return vec![("y", values(y)), ("dx", grad(&x, &grads)), ("da", param_grad(&adapter.lora_a)), ("db", param_grad(&adapter.lora_b)), ("dm", dm)];
        }
        let (a, b, magnitude) = (a.require_grad(), b.require_grad(), magnitude.require_grad());
        let delta = a.clone().transpose().matmul(b.clone().transpose()) * config.scale();
        let norm = (w.clone() + delta.clone()).square().sum_dim(0).sqrt().detach();
        let c = (magnitude.clone().unsqueeze::<2>() / norm).unsqueeze::<3>();
        let x_dropped = match mask {
            Some(mask) => dropped(x.clone(), mask),
            None => x.clone(),
        };
        let mut y = x.clone().matmul(w.clone().unsqueeze()) + (c.clone() - 1.0) * x_dropped.clone().matmul(w.unsqueeze()) + c * x_dropped.matmul(delta.unsqueeze());
        if let Some(bias) = bias {
            y = y + bias.unsqueeze::<3>();
        }
        let grads = weighted(y.clone(), loss_seed, device).backward();
        vec![("y", values(y)), ("dx", grad(&x, &grads)), ("da", grad(&a, &grads)), ("db", grad(&b, &grads)), ("dm", grad(&magnitude, &grads))]
    }

    fn depth(&self) -> f64 {
        self.d_in.max(self.d_out).max(self.batch * self.m) as f64
    }

    fn footprint(&self) -> usize {
        self.batch * self.m * (2 * self.d_in + 3 * self.d_out) + self.d_in * self.d_out * 2
    }
}
