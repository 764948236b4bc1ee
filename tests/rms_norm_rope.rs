//! Fused QK-norm + RoPE vs the unfused reference: q/k outputs and dq, dk, dγ_q, dγ_k, with GQA
//! head ratios, ragged sequence lengths, offsets, transposed views, f32/f16.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor};
use common::checks::{RmsNormRopeCase, assert_cases};
use kiln::ops::{RopeTable, rope::RopeScaling};

fn cases() -> Vec<RmsNormRopeCase> {
    let mut cases = Vec::new();
    for (i, (batch, seq, q_heads, kv_heads, head_dim)) in
        [(1, 1, 1, 1, 2), (2, 7, 4, 2, 6), (1, 17, 8, 1, 64), (2, 5, 6, 3, 128), (1, 9, 2, 2, 80)].into_iter().enumerate()
    {
        for (offset, transposed) in [(0, false), (3, true)] {
            cases.push(RmsNormRopeCase { batch, seq, q_heads, kv_heads, head_dim, offset, transposed, seed: 31 * i as u64 });
        }
    }
    cases
}


#[test]
fn rms_norm_rope_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases(), &device, &[DType::F32, DType::F16]);
}

#[test]
fn rms_norm_rope_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

#[test]
fn rms_norm_rope_rejects_mismatched_seq() {
    let device = Default::default();
    let table = RopeTable::<NdArray>::new(8, 16, 10_000.0, RopeScaling::None, &device);
    let q = Tensor::<NdArray, 4>::ones([1, 3, 2, 8], &device);
    let k = Tensor::<NdArray, 4>::ones([1, 4, 2, 8], &device);
    let g = Tensor::<NdArray, 1>::ones([8], &device);
    let msg = common::panic_message(|| kiln::ops::rms_norm_rope(q, k, g.clone(), g, &table, 0, 1e-6));
    assert!(msg.contains("kiln::rms_norm_rope") && msg.contains("[1, 3, 2, 8]") && msg.contains("[1, 4, 2, 8]"), "{msg}");
}
