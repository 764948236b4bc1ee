//! DoRA on the H100: parity of the rescaling op and of whole DoRA layers (PEFT's dense formula,
//! every gradient) in f32/bf16, and a DoRA / QDoRA layer's training step next to its base and
//! its LoRA step; PEFT's DoRA (which forms `B·A` and the whole weight's norm every step) runs the
//! same steps in `peers/dora.py` in the same call.

use burn::backend::cuda::CudaDevice;
use burn::tensor::{DType, Distribution, Tensor};
use kiln::nn::{Linear, LinearLayer, LoraLinear};

use super::common::adapters::{DoraCase, DoraLayerCase, DoraNormCase};
use super::common::checks::prim;
use super::lora::{Ad, STEPS, adapter, bf16, rank, step, step_inputs, tokens};

pub fn op_cases() -> Vec<DoraCase> {
    let case = |batch, m, d_out, bias, seed| DoraCase { batch, m, d_out, bias, seed };
    vec![case(1, 1, 4096, false, 1), case(2, 333, 1001, true, 2), case(1, 4096, 11008, false, 3)]
}

/// The factored norm at a benched layer's shape (rank 16), rank 64 over 11008 outputs, and a
/// ragged one.
pub fn norm_cases() -> Vec<DoraNormCase> {
    let case = |d_in, d_out, rank, seed| DoraNormCase { d_in, d_out, rank, scale: 2.0, seed };
    vec![case(4096, 4096, 16, 1), case(2048, 11008, 64, 2), case(1000, 257, 8, 3)]
}

pub fn layer_cases() -> Vec<DoraLayerCase> {
    let case = |batch, m, d_in, d_out, rank, rslora, bias, dropout, seed| DoraLayerCase { batch, m, d_in, d_out, rank, rslora, bias, dropout, seed };
    vec![case(1, 512, 4096, 1024, 16, false, false, 0.0, 1), case(2, 33, 1000, 257, 8, true, true, 0.1, 2), case(1, 64, 520, 96, 64, false, false, 0.0, 3)]
}

/// A bf16 adapter with random `A` and `B` (a trained adapter's work), DoRA when `dora`.
fn adapted<L: LinearLayer<Ad>>(base: L, dora: bool, dropout: f64, device: &CudaDevice) -> LoraLinear<Ad, L> {
    let d_out = base.d_output();
    let adapter = adapter(base.d_input(), d_out, dropout, device);
    let adapter = if dora { adapter.with_magnitude(Tensor::<Ad, 1>::random([d_out], Distribution::Uniform(0.5, 1.5), device).cast(DType::BF16)) } else { adapter };
    LoraLinear::frozen(base).with_adapter(adapter)
}

/// DoRA steps (bf16 float base, rank 16; with dropout 0.1; on an NF4 base) next to the base alone
/// and the LoRA step, 4096 tokens.
pub fn bench_steps(device: &CudaDevice) {
    let (tokens, rank) = (tokens(), rank());
    for (d_in, d_out) in STEPS {
        let (x, dy, linear, nf4) = step_inputs(tokens, d_in, d_out, device);
        let base = step(&LoraLinear::frozen(linear.clone()), &x, &dy, device);
        let lora = step(&adapted(linear.clone(), false, 0.0, device), &x, &dy, device);
        let dora = step(&adapted(linear.clone(), true, 0.0, device), &x, &dy, device);
        let dora_dropout = step(&adapted(linear.clone(), true, 0.1, device), &x, &dy, device);
        let qbase = step(&LoraLinear::frozen(nf4.clone()), &x, &dy, device);
        let qdora = step(&adapted(nf4, true, 0.0, device), &x, &dy, device);
        let ms = |t: f64| t * 1e3;
        println!(
            "bench dora step t{tokens} k{d_in} n{d_out} r{rank} bf16: kiln base {:.3} ms, lora {:.3} ms, dora {:.3} ms (+{:.3} over lora), dora+dropout0.1 {:.3} ms | nf4 base {:.3} ms, qdora {:.3} ms",
            ms(base),
            ms(lora),
            ms(dora),
            ms(dora - lora),
            ms(dora_dropout),
            ms(qbase),
            ms(qdora)
        );
        parts(&linear, &x, &dy, device);
    }
}

/// DoRA and QDoRA steps (4096 tokens, rank 16) on the fused layer kernel and with
/// `KILN_LORA_LINEAR=0`, alternated for three rounds, each next to its base's step.
pub fn bench_rounds(device: &CudaDevice) {
    let (tokens, rank) = (tokens(), rank());
    for (d_in, d_out) in STEPS {
        let (x, dy, linear, nf4) = step_inputs(tokens, d_in, d_out, device);
        let (base, dora) = (LoraLinear::frozen(linear.clone()), adapted(linear, true, 0.0, device));
        let (qbase, qdora) = (LoraLinear::frozen(nf4.clone()), adapted(nf4, true, 0.0, device));
        let ms = |t: f64| t * 1e3;
        for round in 0..3 {
            let [fused, composed] = ["1", "0"].map(|value| {
                super::lora::with_fused_layer(value, || {
                    let (b, d, qb, qd) = (step(&base, &x, &dy, device), step(&dora, &x, &dy, device), step(&qbase, &x, &dy, device), step(&qdora, &x, &dy, device));
                    format!("base {:.3} ms, dora {:.3} ms ({:.3}x); nf4 base {:.3} ms, qdora {:.3} ms ({:.3}x)", ms(b), ms(d), d / b, ms(qb), ms(qd), qd / qb)
                })
            });
            println!("bench dora step t{tokens} k{d_in} n{d_out} r{rank} bf16 round {round}: fused layer {fused} | KILN_LORA_LINEAR=0 {composed}");
        }
    }
}

/// Where a DoRA step's time goes, at one shape: the forward alone (LoRA and DoRA layers), the
/// factored norm alone, and the rescaling op alone (its forward, and its forward + backward of `u`
/// and `m` net of the loss ops around it). Each call's results are dropped as it returns, so the
/// pool reuses their memory as a training loop does: holding a hundred `[4096, n]` gradients made
/// the op look 1.3–1.7 ms slower than it is (pool growth; 21st and 28th sessions).
fn parts(linear: &Linear<Ad>, x: &Tensor<Ad, 2>, dy: &Tensor<Ad, 2>, device: &CudaDevice) {
    let tokens = tokens();
    let (d_in, d_out) = (linear.d_input(), linear.d_output());
    let time = |f: &dyn Fn()| super::time_adaptive(device, 0.3, 100, f);
    let (lora, dora) = (adapted(linear.clone(), false, 0.0, device), adapted(linear.clone(), true, 0.0, device));
    let lora_fwd = time(&|| drop(lora.forward(x.clone().detach())));
    let dora_fwd = time(&|| drop(dora.forward(x.clone().detach())));
    let adapter = dora.adapter.as_ref().unwrap();
    let norms_sq = dora.base_norms_sq.clone().unwrap();
    let (a, b) = (adapter.lora_a.val().detach(), adapter.lora_b.val().detach());
    let norm = time(&|| drop(kiln::ops::dora_norm(norms_sq.clone(), linear.forward(a.clone()), a.clone(), b.clone(), adapter.scale())));
    // The same factors through the composed Burn ops (the reference), for the kernels' share.
    let (a_i, b_i, w_sq_i) = (prim(a.clone().inner()), prim(b.inner()), prim(norms_sq.clone().inner()));
    let composed = time(&|| {
        let a_w = prim(linear.forward(a.clone()).inner());
        drop(kiln::ops::dora::reference::norm::<super::B>(w_sq_i.clone(), a_w, a_i.clone(), b_i.clone(), adapter.scale()))
    });
    let u = bf16([tokens, d_out], 1.0, device).require_grad();
    let m = Tensor::<Ad, 1>::random([d_out], Distribution::Uniform(0.5, 1.5), device).cast(DType::BF16).require_grad();
    let n = Tensor::<Ad, 1>::random([d_out], Distribution::Uniform(0.5, 1.5), device);
    let (ui, mi, ni) = (u.clone().inner(), m.clone().inner(), n.clone().inner());
    let op_fwd = time(&|| drop(kiln::ops::dora(ui.clone(), mi.clone(), ni.clone(), None)));
    let loss = time(&|| drop(super::lora::loss_step(&u, dy)));
    let op = time(&|| {
        let grads = (kiln::ops::dora(u.clone(), m.clone(), n.clone(), None) * dy.clone()).sum().backward();
        drop((u.grad(&grads), m.grad(&grads)))
    });
    let ms = |t: f64| t * 1e3;
    println!(
        "bench dora parts t{tokens} k{d_in} n{d_out}: forward lora {:.3} ms, dora {:.3} ms; norm alone {:.3} ms (composed Burn ops {:.3} ms); rescale op fwd {:.3} ms, fwd+bwd {:.3} ms net of the loss ops ({:.3} ms)",
        ms(lora_fwd),
        ms(dora_fwd),
        ms(norm),
        ms(composed),
        ms(op_fwd),
        ms(op - loss),
        ms(loss)
    );
}
