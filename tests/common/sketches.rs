//! The fused sketched-AdamW step against its reference composition, shared by the CI tests (wgpu)
//! and the GPU check (CUDA).

use burn::tensor::{DType, ElementConversion, Tensor, TensorData, TensorPrimitive};
use kiln::ops::sketch::{self, Sketch, SketchBackend};

use super::{poison, random, unit_roundoff};

/// `n` f32 values of N(0, 1), from `seed`.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    random(&[n], seed).convert::<f32>().into_vec().unwrap()
}

/// The fused step (two kernels) against the reference composition (`reference::adamw_step`: the
/// backend's own sketch passes and elementwise ops), three steps with the state carried: moments
/// within f32 roundings, the parameter within one rounding of its dtype (both paths compute in
/// f32 and round once; fused multiply-adds move the f32 values by an ulp).
pub fn check_step<B: SketchBackend>(device: &B::Device, sizes: &[(usize, usize)], dtypes: &[DType]) {
    let max_abs = |t: &Tensor<B, 1>| -> f32 { t.clone().cast(DType::F32).abs().max().into_scalar().elem() };
    let wrap = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t));
    for &(n, r) in sizes {
        let s = Sketch::new(n, r, 4).unwrap();
        for &dtype in dtypes {
            let ctx = format!("n {n} r {r} {dtype:?}");
            let start = Tensor::<B, 1>::from_data(TensorData::new(values(n, 30), [n]), device).cast(dtype);
            let zeros = || Tensor::<B, 1>::zeros([s.compressed()], (device, DType::F32));
            let (mut fused, mut reference) = ((start.clone(), [zeros(), zeros()]), (start.clone(), [zeros(), zeros()]));
            for t in 1..=3 {
                let g = Tensor::<B, 1>::from_data(TensorData::new(values(n, 30 + t as u64), [n]), device).cast(dtype);
                let scalars = sketch::AdamWScalars::new(0.9, 0.999, 1e-6, 0.01, 3e-2, t, r);
                poison::<B>(device, 4 * n, DType::F32);
                fused = sketch::adamw_step(fused.0, g.clone(), fused.1, &s, scalars);
                let moments = reference.1.map(|m| m.into_primitive().tensor());
                let [w, m, v] = sketch::reference::adamw_step::<B>(reference.0.into_primitive().tensor(), g.into_primitive().tensor(), moments, s, scalars);
                reference = (wrap(w), [wrap(m), wrap(v)]);
                for (i, name) in [(0, "moment_1"), (1, "moment_2")] {
                    let tol = 4.0 * f32::EPSILON * max_abs(&reference.1[i]);
                    let diff = max_abs(&(fused.1[i].clone() - reference.1[i].clone()));
                    assert!(diff <= tol, "{ctx} step {t}: {name} differs by {diff} (tolerance {tol})");
                }
                let tol = 4.0 * unit_roundoff(dtype) as f32 * max_abs(&reference.0);
                let diff = max_abs(&(fused.0.clone().cast(DType::F32) - reference.0.clone().cast(DType::F32)));
                assert!(diff <= tol, "{ctx} step {t}: parameter differs by {diff} (tolerance {tol})");
                assert_eq!(fused.0.dtype(), dtype, "{ctx}: parameter dtype");
            }
            assert!(max_abs(&(fused.0.cast(DType::F32) - start.cast(DType::F32))) > 0.0, "{ctx}: the parameter moved");
        }
    }
}
