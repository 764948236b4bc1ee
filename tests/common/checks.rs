//! One case type per op: each runs the op forward and backward, either through kiln (`kernel`)
//! or through its reference implementation, and returns every output and gradient on the host.

use burn::tensor::{DType, Tensor, TensorPrimitive, backend::Backend};
use kiln::KilnAutodiffBackend;
use kiln::ops::{
    self, AttentionOptions, RopeTable, flash_attention, rms_norm, rms_norm_rope, rope, rope::RopeScaling, swiglu,
    swiglu::GluActivation,
};

use super::{Comparison, Oracle, assert_all, compare, poison, random, tensor, values};

type Outputs = Vec<(&'static str, Vec<f64>)>;

/// An op invocation with fixed shapes and data.
pub trait Case {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs;
    /// Length of the longest reduction behind an output element (scales the rounding term).
    fn depth(&self) -> f64;
    /// [`Case::depth`] for outputs in `dtype`: an op that reduces in f32 whatever its dtype and
    /// rounds once to it counts its reductions only where `dtype` is that precision or finer.
    fn depth_in(&self, _dtype: DType) -> f64 {
        self.depth()
    }
    /// Elements the outputs need, for poisoning the memory pool.
    fn footprint(&self) -> usize;
}

/// Run `case` through kiln and the reference on `B` in `dtype`, and through the f64 oracle.
pub fn check<B: KilnAutodiffBackend, C: Case>(case: &C, device: &B::Device, dtype: DType) -> Vec<Comparison> {
    poison::<B>(device, case.footprint() * 4, dtype);
    let kernel = case.run::<B>(device, dtype, true);
    let reference = case.run::<B>(device, dtype, false);
    let oracle = case.run::<Oracle>(&Default::default(), DType::F64, false);
    kernel
        .iter()
        .zip(&reference)
        .zip(&oracle)
        .map(|(((name, k), (_, r)), (_, o))| compare(name, k, r, o, dtype, case.depth_in(dtype)))
        .collect()
}

/// Check every case in every dtype on `B`; a failure names the case and dtype.
#[track_caller]
pub fn assert_cases<B: KilnAutodiffBackend, C: Case + std::fmt::Debug>(cases: &[C], device: &B::Device, dtypes: &[DType]) {
    for &dtype in dtypes {
        for case in cases {
            eprintln!("checking {case:?} {dtype:?}");
            assert_all(&format!("{case:?} {dtype:?}"), &check::<B, _>(case, device, dtype));
        }
    }
}

pub fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
    t.into_primitive().tensor()
}

pub fn wrap<B: Backend, const D: usize>(t: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `Σ out · w` for a fixed random `w`: a loss whose gradient w.r.t. `out` is `w`.
pub fn weighted<B: Backend, const D: usize>(out: Tensor<B, D>, seed: u64, device: &B::Device) -> Tensor<B, 1> {
    let w = tensor::<B, D>(&random(&out.dims(), seed), out.dtype(), device);
    (out * w).sum()
}

pub fn grad<B: burn::tensor::backend::AutodiffBackend, const D: usize>(t: &Tensor<B, D>, grads: &B::Gradients) -> Vec<f64> {
    values(t.grad(grads).expect("input has a gradient"))
}

/// `rms_norm(x [+ residual]) · γ` on `[a, b, width]`.
#[derive(Debug)]
pub struct RmsNormCase {
    pub shape: [usize; 3],
    pub residual: bool,
    pub seed: u64,
}

impl Case for RmsNormCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        const EPS: f64 = 1e-6;
        let width = self.shape[2];
        let x = tensor::<B, 3>(&random(&self.shape, self.seed), dtype, device).require_grad();
        let r = tensor::<B, 3>(&random(&self.shape, self.seed + 1), dtype, device).require_grad();
        let g = tensor::<B, 1>(&random(&[width], self.seed + 2), dtype, device).require_grad();
        let (y, h) = match (kernel, self.residual) {
            (true, true) => ops::rms_norm_residual(x.clone(), r.clone(), g.clone(), EPS),
            (true, false) => (ops::rms_norm(x.clone(), g.clone(), EPS), x.clone()),
            (false, residual) => {
                let res = residual.then(|| prim(r.clone()));
                let out = rms_norm::reference::forward::<B>(prim(x.clone()), prim(g.clone()), res, EPS);
                (wrap(out.output), out.residual.map(wrap).unwrap_or_else(|| x.clone()))
            }
        };
        let mut loss = weighted(y.clone(), self.seed + 3, device);
        if self.residual {
            loss = loss + weighted(h.clone(), self.seed + 4, device);
        }
        let grads = loss.backward();
        let mut out = vec![("y", values(y)), ("dx", grad(&x, &grads)), ("dgamma", grad(&g, &grads))];
        if self.residual {
            out.push(("h", values(h)));
            out.push(("dresidual", grad(&r, &grads)));
        }
        out
    }

    fn depth(&self) -> f64 {
        (self.shape[2].max(self.shape[0] * self.shape[1])) as f64
    }

    fn footprint(&self) -> usize {
        self.shape.iter().product::<usize>() * 3
    }
}

/// RoPE on `[batch, seq, heads, head_dim]`, optionally given as a transposed
/// `[batch, heads, seq, head_dim]` tensor's view.
#[derive(Debug)]
pub struct RopeCase {
    pub shape: [usize; 4],
    pub offset: usize,
    pub transposed: bool,
    pub scaling: RopeScaling,
    pub seed: u64,
}

impl RopeCase {
    fn table<B: Backend>(&self, device: &B::Device) -> RopeTable<B> {
        RopeTable::new(self.shape[3], self.offset + self.shape[1] + 3, 10_000.0, self.scaling, device)
    }
}

/// The input as `[batch, seq, heads, head_dim]`, built transposed when asked.
fn heads_input<B: Backend>(shape: [usize; 4], transposed: bool, seed: u64, dtype: DType, device: &B::Device) -> Tensor<B, 4> {
    let [b, s, h, d] = shape;
    if transposed {
        tensor::<B, 4>(&random(&[b, h, s, d], seed), dtype, device).require_grad()
    } else {
        tensor::<B, 4>(&random(&shape, seed), dtype, device).require_grad()
    }
}

fn as_bshd<B: Backend>(t: Tensor<B, 4>, transposed: bool) -> Tensor<B, 4> {
    if transposed { t.swap_dims(1, 2) } else { t }
}

impl Case for RopeCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let table = self.table::<B>(device);
        let x = heads_input::<B>(self.shape, self.transposed, self.seed, dtype, device);
        let xv = as_bshd(x.clone(), self.transposed);
        let y = if kernel {
            ops::rope(xv, &table, self.offset)
        } else {
            wrap(rope::reference::rotate::<B>(prim(xv), prim(table.cos()), prim(table.sin()), self.offset, false))
        };
        let grads = weighted(y.clone(), self.seed + 1, device).backward();
        vec![("y", values(y)), ("dx", grad(&x, &grads))]
    }

    fn depth(&self) -> f64 {
        2.0
    }

    fn footprint(&self) -> usize {
        self.shape.iter().product::<usize>() * 2
    }
}

/// Fused QK-norm + RoPE on q `[b, s, hq, d]` and k `[b, s, hk, d]`.
#[derive(Debug)]
pub struct RmsNormRopeCase {
    pub batch: usize,
    pub seq: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub offset: usize,
    pub transposed: bool,
    pub seed: u64,
}

impl Case for RmsNormRopeCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        const EPS: f64 = 1e-6;
        let d = self.head_dim;
        let table = RopeTable::<B>::new(d, self.offset + self.seq + 1, 1_000_000.0, RopeScaling::None, device);
        let q = heads_input::<B>([self.batch, self.seq, self.q_heads, d], self.transposed, self.seed, dtype, device);
        let k = heads_input::<B>([self.batch, self.seq, self.kv_heads, d], self.transposed, self.seed + 1, dtype, device);
        let qg = tensor::<B, 1>(&random(&[d], self.seed + 2), dtype, device).require_grad();
        let kg = tensor::<B, 1>(&random(&[d], self.seed + 3), dtype, device).require_grad();
        let (qv, kv) = (as_bshd(q.clone(), self.transposed), as_bshd(k.clone(), self.transposed));
        let (qo, ko) = if kernel {
            ops::rms_norm_rope(qv, kv, qg.clone(), kg.clone(), &table, self.offset, EPS)
        } else {
            let out = rms_norm_rope::reference::forward::<B>(
                prim(qv), prim(kv), prim(qg.clone()), prim(kg.clone()), prim(table.cos()), prim(table.sin()), self.offset, EPS,
            );
            (wrap(out.q), wrap(out.k))
        };
        let loss = weighted(qo.clone(), self.seed + 4, device) + weighted(ko.clone(), self.seed + 5, device);
        let grads = loss.backward();
        vec![
            ("q", values(qo)),
            ("k", values(ko)),
            ("dq", grad(&q, &grads)),
            ("dk", grad(&k, &grads)),
            ("dq_gamma", grad(&qg, &grads)),
            ("dk_gamma", grad(&kg, &grads)),
        ]
    }

    fn depth(&self) -> f64 {
        (self.head_dim.max(self.batch * self.seq * self.q_heads)) as f64
    }

    fn footprint(&self) -> usize {
        self.batch * self.seq * (self.q_heads + self.kv_heads) * self.head_dim * 2
    }
}

/// `act(gate) · up` on `[a, b]`.
#[derive(Debug)]
pub struct GluCase {
    pub shape: [usize; 2],
    pub activation: GluActivation,
    pub seed: u64,
}

impl Case for GluCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let g = tensor::<B, 2>(&random(&self.shape, self.seed), dtype, device).require_grad();
        let u = tensor::<B, 2>(&random(&self.shape, self.seed + 1), dtype, device).require_grad();
        let y = match kernel {
            true => ops::glu(g.clone(), u.clone(), self.activation),
            false => wrap(swiglu::reference::forward::<B>(prim(g.clone()), prim(u.clone()), self.activation)),
        };
        let grads = weighted(y.clone(), self.seed + 2, device).backward();
        vec![("y", values(y)), ("dgate", grad(&g, &grads)), ("dup", grad(&u, &grads))]
    }

    fn depth(&self) -> f64 {
        2.0
    }

    fn footprint(&self) -> usize {
        self.shape.iter().product::<usize>() * 3
    }
}

/// Attention of q `[batch, q_heads, q_len, d]` over k, v `[batch, kv_heads, kv_len, d]`, with an
/// optional bias broadcast over the batch.
#[derive(Debug, Clone, Copy)]
pub struct AttentionCase {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
    pub options: AttentionOptions,
    pub bias: bool,
    pub seed: u64,
}

impl AttentionCase {
    /// A case with default options and no bias.
    pub fn new(batch: usize, q_heads: usize, kv_heads: usize, q_len: usize, kv_len: usize, head_dim: usize) -> Self {
        Self { batch, q_heads, kv_heads, q_len, kv_len, head_dim, options: AttentionOptions::default(), bias: false, seed: 0 }
    }
}

impl Case for AttentionCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let (q_shape, kv_shape) = ([self.batch, self.q_heads, self.q_len, self.head_dim], [self.batch, self.kv_heads, self.kv_len, self.head_dim]);
        let q = tensor::<B, 4>(&random(&q_shape, self.seed), dtype, device).require_grad();
        let k = tensor::<B, 4>(&random(&kv_shape, self.seed + 1), dtype, device).require_grad();
        let v = tensor::<B, 4>(&random(&kv_shape, self.seed + 2), dtype, device).require_grad();
        let bias = self.bias.then(|| tensor::<B, 4>(&random(&[1, self.q_heads, self.q_len, self.kv_len], self.seed + 3), dtype, device));
        let out = if kernel {
            ops::flash_attention(q.clone(), k.clone(), v.clone(), bias, self.options)
        } else {
            let full = [self.batch, self.q_heads, self.q_len, self.kv_len];
            let bias = bias.map(|b| prim(b.expand(full)));
            wrap(flash_attention::reference::forward::<B>(prim(q.clone()), prim(k.clone()), prim(v.clone()), bias, self.options).output)
        };
        let grads = weighted(out.clone(), self.seed + 4, device).backward();
        vec![("out", values(out)), ("dq", grad(&q, &grads)), ("dk", grad(&k, &grads)), ("dv", grad(&v, &grads))]
    }

    fn depth(&self) -> f64 {
        let group = self.q_heads / self.kv_heads;
        self.kv_len.max(self.head_dim).max(self.q_len * group) as f64
    }

    fn footprint(&self) -> usize {
        (self.q_heads * self.q_len + 2 * self.kv_heads * self.kv_len) * self.head_dim * self.batch * 2
    }
}

/// A dense product through the public API: `matmul` of `[batch, m, k] · [batch | 1, k, n]`
/// (operands optionally given as transposed views), or `linear`/`linear_residual` of
/// `[batch, m, k]` with a `[k, n]` weight.
#[derive(Debug, Clone, Copy)]
pub struct GemmCase {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub kind: GemmKind,
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmKind {
    /// `matmul`; the flags make each operand a transposed view of `[.., cols, rows]` storage.
    Matmul { transpose_lhs: bool, transpose_rhs: bool, shared_rhs: bool },
    /// `linear` (with bias) or, with `residual`, `linear_residual`.
    Linear { bias: bool, residual: bool },
}

impl GemmCase {
    /// A view of `[a, r, c]` data, stored as `[a, c, r]` and transposed when `transposed`.
    fn operand<B: burn::tensor::backend::AutodiffBackend>(shape: [usize; 3], transposed: bool, seed: u64, dtype: DType, device: &B::Device) -> Tensor<B, 3> {
        if transposed {
            tensor::<B, 3>(&random(&[shape[0], shape[2], shape[1]], seed), dtype, device).require_grad()
        } else {
            tensor::<B, 3>(&random(&shape, seed), dtype, device).require_grad()
        }
    }
}

impl Case for GemmCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let (b, m, k, n, s) = (self.batch, self.m, self.k, self.n, self.seed);
        match self.kind {
            GemmKind::Matmul { transpose_lhs, transpose_rhs, shared_rhs } => {
                let lhs = Self::operand::<B>([b, m, k], transpose_lhs, s, dtype, device);
                let rhs = Self::operand::<B>([if shared_rhs { 1 } else { b }, k, n], transpose_rhs, s + 1, dtype, device);
                let view = |t: &Tensor<B, 3>, transposed: bool| if transposed { t.clone().swap_dims(1, 2) } else { t.clone() };
                let (l, r) = (view(&lhs, transpose_lhs), view(&rhs, transpose_rhs));
                let y = if kernel { ops::matmul(l, r) } else { l.matmul(r) };
                let grads = weighted(y.clone(), s + 2, device).backward();
                vec![("y", values(y)), ("dlhs", grad(&lhs, &grads)), ("drhs", grad(&rhs, &grads))]
            }
            GemmKind::Linear { bias, residual } => {
                let x = Self::operand::<B>([b, m, k], false, s, dtype, device);
                let w = tensor::<B, 2>(&random(&[k, n], s + 1), dtype, device).require_grad();
                let bv = tensor::<B, 1>(&random(&[n], s + 2), dtype, device).require_grad();
                let res = tensor::<B, 3>(&random(&[b, m, n], s + 3), dtype, device).require_grad();
                let y = match (kernel, residual) {
                    (true, false) => ops::linear(x.clone(), w.clone(), bias.then(|| bv.clone())),
                    (true, true) => ops::linear_residual(x.clone(), w.clone(), bias.then(|| bv.clone()), res.clone()),
                    (false, _) => {
                        let mut y = x.clone().matmul(w.clone().unsqueeze());
                        if bias {
                            y = y + bv.clone().unsqueeze();
                        }
                        if residual { y + res.clone() } else { y }
                    }
                };
                let grads = weighted(y.clone(), s + 4, device).backward();
                let mut out = vec![("y", values(y)), ("dx", grad(&x, &grads)), ("dw", grad(&w, &grads))];
                if bias {
                    out.push(("dbias", grad(&bv, &grads)));
                }
                if residual {
                    out.push(("dresidual", grad(&res, &grads)));
                }
                out
            }
        }
    }

    fn depth(&self) -> f64 {
        self.k.max(self.n).max(self.batch * self.m) as f64
    }

    fn footprint(&self) -> usize {
        self.batch * (self.m * self.k + self.m * self.n) + self.k * self.n * self.batch
    }
}

/// `x [m, k] · Wᵀ` for a 4-bit `W [n, k]` quantized once on the host (so every backend holds the
/// same codes), with the input gradient; the reference multiplies by the weight dequantized with
/// plain Burn ops.
#[derive(Debug, Clone, Copy)]
pub struct Nf4Case {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub kind: ops::nf4::QuantType,
    pub block: usize,
    pub nested: bool,
    pub seed: u64,
}

impl Nf4Case {
    /// The host quantization of this case's weight.
    pub fn packed(&self) -> ops::nf4::Packed4 {
        let w: Vec<f32> = random(&[self.n, self.k], self.seed + 1).convert::<f32>().into_vec().unwrap();
        ops::nf4::Packed4::quantize(&w, &[self.n, self.k], self.kind, self.block, self.nested).unwrap()
    }
}

impl Case for Nf4Case {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let w = ops::nf4::Quantized4::<B>::from_host(&self.packed(), device).unwrap();
        let x = tensor::<B, 2>(&random(&[self.m, self.k], self.seed), dtype, device).require_grad();
        let y = if kernel {
            ops::matmul_4bit(x.clone(), &w)
        } else {
            let dense: Tensor<B, 2> = wrap(ops::nf4::reference::dequantize::<B>(w.primitive(), dtype));
            x.clone().matmul(dense.transpose())
        };
        let grads = weighted(y.clone(), self.seed + 2, device).backward();
        vec![("y", values(y)), ("dx", grad(&x, &grads))]
    }

    fn depth(&self) -> f64 {
        self.k.max(self.n) as f64
    }

    fn footprint(&self) -> usize {
        self.m * (self.k + self.n) + self.k * self.n
    }
}

/// Per-row cross-entropy of `[rows, width]` logits (N(0, 1) times `scale`) against targets
/// spread over the row, every `ignore_every`-th row ignored (target −100; 0: none), and the
/// logits' gradient under random per-row loss weights.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyCase {
    pub rows: usize,
    pub width: usize,
    pub scale: f64,
    pub ignore_every: usize,
    pub seed: u64,
}

impl CrossEntropyCase {
    pub fn targets(&self) -> Vec<i64> {
        let spread = |r: usize| ((r as u64 * 2_654_435_761 + self.seed) % self.width as u64) as i64;
        (0..self.rows).map(|r| if self.ignore_every > 0 && r % self.ignore_every == 1 { -100 } else { spread(r) }).collect()
    }
}

impl Case for CrossEntropyCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        let shape = [self.rows, self.width];
        let scaled: Vec<f64> = random(&shape, self.seed).to_vec::<f64>().unwrap().iter().map(|v| v * self.scale).collect();
        let z = tensor::<B, 2>(&burn::tensor::TensorData::new(scaled, shape), dtype, device).require_grad();
        let t = Tensor::<B, 1, burn::tensor::Int>::from_data(burn::tensor::TensorData::new(self.targets(), [self.rows]), device);
        let loss = if kernel {
            ops::cross_entropy(z.clone(), t)
        } else {
            wrap(ops::cross_entropy::reference::forward::<B>(prim(z.clone()), t.into_primitive()).0)
        };
        let grads = weighted(loss.clone(), self.seed + 1, device).backward();
        vec![("loss", values(loss)), ("dlogits", grad(&z, &grads))]
    }

    fn depth(&self) -> f64 {
        self.width as f64
    }

    /// The kernels sum over the row in f32 and round each output once (the losses stay f32):
    /// in f16/bf16 that rounding is the whole term. Counting the row's f32 sums at the half
    /// dtype's unit roundoff made the bound about as large as the gradients in f16 at 32000
    /// classes and several times larger in bf16 at 128256: a check that could not fail.
    fn depth_in(&self, dtype: DType) -> f64 {
        if matches!(dtype, DType::F16 | DType::BF16) { 1.0 } else { self.depth() }
    }

    fn footprint(&self) -> usize {
        3 * self.rows * self.width
    }
}

/// `linear_cross_entropy(hidden [rows, d], weight [d, vocab], targets)`, the weight given as is
/// or (`tied`) as the transpose of a `[vocab, d]` tensor, as a tied embedding enters.
#[derive(Debug)]
pub struct LinearCrossEntropyCase {
    pub rows: usize,
    pub d: usize,
    pub vocab: usize,
    pub chunk_rows: Option<usize>,
    pub reduction: ops::linear_cross_entropy::Reduction,
    pub tied: bool,
    pub ignore_every: usize,
    pub seed: u64,
}

impl Case for LinearCrossEntropyCase {
    fn run<B: KilnAutodiffBackend>(&self, device: &B::Device, dtype: DType, kernel: bool) -> Outputs {
        use ops::linear_cross_entropy::{LinearCrossEntropyOptions, reference};
        // Logits of unit scale: hidden ~ N(0, 1/d), weight ~ N(0, 1).
        let shrink = 1.0 / (self.d as f64).sqrt();
        let scaled: Vec<f64> = random(&[self.rows, self.d], self.seed).to_vec::<f64>().unwrap().iter().map(|v| v * shrink).collect();
        let h = tensor::<B, 2>(&burn::tensor::TensorData::new(scaled, [self.rows, self.d]), dtype, device).require_grad();
        let stored = if self.tied { [self.vocab, self.d] } else { [self.d, self.vocab] };
        let w = tensor::<B, 2>(&random(&stored, self.seed + 1), dtype, device).require_grad();
        let weight = if self.tied { w.clone().transpose() } else { w.clone() };
        let targets = CrossEntropyCase { rows: self.rows, width: self.vocab, scale: 1.0, ignore_every: self.ignore_every, seed: self.seed }.targets();
        let t = Tensor::<B, 1, burn::tensor::Int>::from_data(burn::tensor::TensorData::new(targets, [self.rows]), device);
        let loss = if kernel {
            let options = LinearCrossEntropyOptions { reduction: self.reduction, chunk_rows: self.chunk_rows };
            ops::linear_cross_entropy(h.clone(), weight, t, options)
        } else {
            wrap(reference::loss::<B>(prim(h.clone()), prim(weight), t.into_primitive(), self.reduction))
        };
        let grads = weighted(loss.clone(), self.seed + 2, device).backward();
        vec![("loss", values(loss)), ("dhidden", grad(&h, &grads)), ("dweight", grad(&w, &grads))]
    }

    /// The products' reductions (`d` for the logits, `rows` for `dW`). The vocabulary-wide sums
    /// are left out: with them the rounding term of f16/bf16 grew past the outputs themselves
    /// (42nd session's bf16 parity: bound 2.8 on gradients of 1e-2), and both paths' rounding of
    /// those sums is in the reference's error already.
    fn depth(&self) -> f64 {
        self.rows.max(self.d) as f64
    }

    fn footprint(&self) -> usize {
        3 * self.rows * self.vocab + 2 * self.d * self.vocab
    }
}
