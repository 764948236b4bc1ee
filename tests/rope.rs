//! RoPE vs its reference: forward and gradient, ragged seq/heads, head_dim 2..128, position
//! offsets (KV-cache decoding), transposed-view inputs, Llama 3.1 frequency scaling, f32/f16.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor};
use common::checks::{RopeCase, assert_cases};
use kiln::ops::{RopeTable, rope::RopeScaling};

const LLAMA3: RopeScaling = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_positions: 16 };

fn cases() -> Vec<RopeCase> {
    let shapes = [[1, 1, 1, 2], [2, 7, 3, 6], [1, 17, 5, 64], [2, 33, 4, 128], [1, 3, 2, 80]];
    let mut cases = Vec::new();
    for (i, shape) in shapes.into_iter().enumerate() {
        for (offset, transposed, scaling) in [(0, false, RopeScaling::None), (5, true, LLAMA3), (11, false, RopeScaling::Linear { factor: 2.0 })] {
            cases.push(RopeCase { shape, offset, transposed, scaling, seed: 7 * i as u64 });
        }
    }
    cases
}


#[test]
fn rope_matches_reference_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    assert_cases::<Autodiff<burn::backend::Wgpu>, _>(&cases(), &device, &[DType::F32, DType::F16]);
}

#[test]
fn rope_runs_through_autodiff_ndarray() {
    assert_cases::<Autodiff<NdArray>, _>(&cases(), &Default::default(), &[DType::F32]);
}

#[test]
fn rope_rejects_positions_past_the_table() {
    let device = Default::default();
    let table = RopeTable::<NdArray>::new(8, 4, 10_000.0, RopeScaling::None, &device);
    let x = Tensor::<NdArray, 4>::ones([1, 3, 2, 8], &device);
    let msg = common::panic_message(|| kiln::ops::rope(x, &table, 2));
    assert!(msg.contains("kiln::rope") && msg.contains("2..5") && msg.contains("[1, 3, 2, 8]"), "{msg}");
}

#[test]
fn rope_rejects_wrong_head_dim() {
    let device = Default::default();
    let table = RopeTable::<NdArray>::new(8, 4, 10_000.0, RopeScaling::None, &device);
    let x = Tensor::<NdArray, 4>::ones([1, 3, 2, 6], &device);
    let msg = common::panic_message(|| kiln::ops::rope(x, &table, 0));
    assert!(msg.contains("kiln::rope") && msg.contains("head_dim 6"), "{msg}");
}

#[test]
fn llama3_scaling_matches_the_published_formula() {
    // Wavelengths below original/high_freq_factor keep their frequency; above
    // original/low_freq_factor they are divided by the factor.
    let device = Default::default();
    let plain = RopeTable::<NdArray>::new(64, 2, 500_000.0, RopeScaling::None, &device);
    let llama31 = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_positions: 8192 };
    let scaled = RopeTable::<NdArray>::new(64, 2, 500_000.0, llama31, &device);
    let angle = |t: &RopeTable<NdArray>| -> Vec<f32> {
        t.sin().slice([1..2]).into_data().to_vec::<f32>().unwrap().iter().map(|s| s.asin()).collect()
    };
    let (p, s) = (angle(&plain), angle(&scaled));
    assert!((p[0] - s[0]).abs() < 1e-6, "highest frequency unchanged");
    assert!((p[31] / 8.0 - s[31]).abs() < 1e-9, "lowest frequency divided by the factor");
}

/// A decode step whose position lives on the device rotates with the table's rows at offset 0:
/// the same values as the whole table at that position, on the kernel path.
#[test]
fn table_rows_rotate_like_the_offset() {
    let Some(device) = common::wgpu_device() else { return };
    type B = burn::backend::Wgpu;
    let table = RopeTable::<B>::new(64, 40, 10_000.0, LLAMA3, &device);
    let x = Tensor::<B, 4>::random([2, 1, 3, 64], burn::tensor::Distribution::Normal(0.0, 1.0), &device);
    for position in [0, 17, 39] {
        let rows = table.rows(Tensor::from_data(burn::tensor::TensorData::new(vec![position as i64], [1]), &device));
        let by_rows = kiln::ops::rope(x.clone(), &rows, 0).into_data();
        let by_offset = kiln::ops::rope(x.clone(), &table, position).into_data();
        assert_eq!(by_rows, by_offset, "position {position}");
    }
}
