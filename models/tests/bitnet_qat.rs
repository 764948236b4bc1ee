//! BitNet b1.58 quantization-aware training on a small Llama: the same model and data trained in
//! full precision and with every attention and MLP linear a `BitLinear`; the QAT loss must come
//! within a stated margin of the float loss, and the packed decoder's logits must equal the QAT
//! decoder's quantized forward exactly.

use burn::backend::{Autodiff, NdArray};
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use kiln_models::train::LmBatch;
use kiln_models::{BitNetOptions, DecoderConfig, FloatDecoder, pack_ternary, to_bitnet};

type B = Autodiff<NdArray>;

const VOCAB: usize = 16;
const SEQ: usize = 12;
const BATCH: usize = 16;
const STEPS: usize = 400;

/// Arithmetic sequences mod `VOCAB` with a start and step per row from `seed` (next-token
/// prediction needs attention to earlier tokens).
fn batch<BK: Backend>(seed: u64, device: &BK::Device) -> LmBatch<BK> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let rows: Vec<i64> = (0..BATCH)
        .flat_map(|_| {
            let (start, step) = (next() % VOCAB as u64, 1 + next() % (VOCAB as u64 - 1));
            (0..=SEQ as u64).map(move |t| ((start + t * step) % VOCAB as u64) as i64)
        })
        .collect();
    let all = Tensor::<BK, 2, Int>::from_data(TensorData::new(rows, [BATCH, SEQ + 1]), device);
    LmBatch { inputs: all.clone().narrow(1, 0, SEQ), targets: all.narrow(1, 1, SEQ), mask: None }
}

fn loss<M: Fn(LmBatch<NdArray>) -> f32>(eval: M, device: &burn::backend::ndarray::NdArrayDevice) -> f32 {
    (0..4).map(|i| eval(batch(10_000 + i, device))).sum::<f32>() / 4.0
}

/// Trains `model` for `STEPS` Adam steps; the validation loss after.
macro_rules! train {
    ($model:expr, $device:expr) => {{
        let mut model = $model;
        let mut optim = AdamConfig::new().init();
        for step in 0..STEPS {
            let loss = model.lm_loss(batch::<B>(step as u64, $device)).loss;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        model.valid()
    }};
}

#[test]
fn bitnet_qat_trains_within_margin_of_float_and_packs_exactly() {
    let device = Default::default();
    // A fixed initialization: the margin below is stated for this run.
    <B as Backend>::seed(&device, 25);
    let config = DecoderConfig::new(VOCAB, 32, 64, 1, 4, 2, 8).with_max_positions(32);
    let init: FloatDecoder<B> = config.init(&device);
    let eval_loss = |m: &dyn Fn(LmBatch<NdArray>) -> f32| loss(m, &device);
    let start = eval_loss(&|b| init.valid().lm_loss(b).loss.into_scalar());

    let float = train!(init.clone(), &device);
    let float_loss = eval_loss(&|b| float.lm_loss(b).loss.into_scalar());
    let qat = train!(to_bitnet(init, BitNetOptions::default()), &device);
    let qat_loss = eval_loss(&|b| qat.lm_loss(b).loss.into_scalar());
    println!("loss at init {start:.3}; after {STEPS} steps: float {float_loss:.3}, BitNet QAT {qat_loss:.3}");
    assert!(float_loss < 0.5 * start, "float training: {start} -> {float_loss}");
    // The stated margin: QAT ends within 0.6 nats of full precision at this size, step count and
    // seed (measured: init 2.77, float 0.53, QAT 0.98). Unseeded runs ranged from QAT 0.08 below
    // float to 0.7 above (at 120 steps), so the seed is part of the claim.
    assert!(qat_loss < float_loss + 0.6, "QAT loss {qat_loss} vs float {float_loss}");

    let packed = pack_ternary(&qat);
    let tokens = batch::<NdArray>(7, &device).inputs;
    let want: Vec<f32> = qat.forward(tokens.clone()).into_data().into_vec().unwrap();
    let got: Vec<f32> = packed.forward(tokens).into_data().into_vec().unwrap();
    assert_eq!(got, want, "packed logits equal the QAT forward");
}
