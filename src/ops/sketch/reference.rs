//! Sketches from plain Burn ops, for any backend: the index maps of the permutation built on the
//! host (O(n) memory, which the kernels avoid), then gathers; bucket sums added in position
//! order, as the host definition does, so the results are the same f32 values.

use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData, backend::Backend, ops::FloatTensor};

use super::{AdamWScalars, Sketch, SketchBackend};
use crate::ops::{prim, wrap};

fn ints<B: Backend>(values: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

fn floats<B: Backend>(values: Vec<f32>, device: &B::Device) -> Tensor<B, 1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32))
}

fn sign(sketch: &Sketch, j: usize) -> f32 {
    if sketch.negative(j) { -1.0 } else { 1.0 }
}

/// [`super::SketchBackend::sketch_compress`].
pub fn compress<B: Backend>(g: FloatTensor<B>, sketch: Sketch, squares: bool) -> FloatTensor<B> {
    let g: Tensor<B, 1> = wrap(g);
    let device = g.device();
    let (n, r, d) = (sketch.n, sketch.ratio, sketch.compressed());
    let columns: Vec<usize> = (0..n).map(|p| sketch.column(p)).collect();
    // Position p's value (signed, or squared), padded with zeros to d · r.
    let mut values = g.cast(DType::F32).select(0, ints::<B>(columns.iter().map(|&j| j as i64).collect(), &device));
    values = if squares { values.clone() * values } else { values * floats::<B>(columns.iter().map(|&j| sign(&sketch, j)).collect(), &device) };
    if d * r > n {
        values = Tensor::cat(vec![values, Tensor::zeros([d * r - n], (&device, DType::F32))], 0);
    }
    let grid = values.reshape([d, r]);
    let mut sum: Tensor<B, 1> = Tensor::zeros([d], (&device, DType::F32));
    for t in 0..r {
        sum = sum + grid.clone().slice([0..d, t..t + 1]).reshape([d]);
    }
    prim(sum)
}

/// [`super::SketchBackend::sketch_decompress`].
pub fn decompress<B: Backend>(c: FloatTensor<B>, sketch: Sketch, signed: bool, dtype: FloatDType) -> FloatTensor<B> {
    let c: Tensor<B, 1> = wrap(c);
    let device = c.device();
    let buckets: Vec<i64> = (0..sketch.n).map(|j| (sketch.position(j) / sketch.ratio) as i64).collect();
    let mut out = c.select(0, ints::<B>(buckets, &device));
    if signed {
        out = out * floats::<B>((0..sketch.n).map(|j| sign(&sketch, j)).collect(), &device);
    }
    prim(out.cast(dtype))
}

/// [`super::SketchBackend::sketch_adamw_step`] from the backend's own compress and decompress and
/// elementwise ops (four passes over the sketch instead of the kernels' two).
pub fn adamw_step<B: SketchBackend>(param: FloatTensor<B>, grad: FloatTensor<B>, moments: [FloatTensor<B>; 2], sketch: Sketch, s: AdamWScalars) -> [FloatTensor<B>; 3] {
    let (w, grad): (Tensor<B, 1>, Tensor<B, 1>) = (wrap(param), wrap(grad));
    let [m, v]: [Tensor<B, 1>; 2] = moments.map(wrap);
    let signed: Tensor<B, 1> = wrap(B::sketch_compress(prim(grad.clone()), sketch, false));
    let squares: Tensor<B, 1> = wrap(B::sketch_compress(prim(grad), sketch, true));
    let m = m * s.beta_1 + signed * (1.0 - s.beta_1);
    let v = v * s.beta_2 + squares * (1.0 - s.beta_2);
    let m_hat: Tensor<B, 1> = wrap(B::sketch_decompress(prim(m.clone() / s.bias_1), sketch, true, FloatDType::F32));
    let v_hat: Tensor<B, 1> = wrap(B::sketch_decompress(prim(v.clone() / s.v_scale), sketch, false, FloatDType::F32));
    let delta = m_hat / (v_hat.sqrt() + s.epsilon);
    let dtype = w.dtype();
    let w = (w.cast(DType::F32) * s.decay - delta * s.lr).cast(dtype);
    [prim(w), prim(m), prim(v)]
}
