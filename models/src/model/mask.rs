//! The additive attention masks the decoder builds on the host: left padding of batched prompts
//! during prefill, and the whole-buffer masks of decode steps (unwritten positions, padding, the
//! sliding window). They are `[batch, 1, q, kv]`, broadcast over heads, 0 or −∞.

use burn::tensor::{DType, Tensor, TensorData, backend::Backend};

fn upload<B: Backend>(bias: Vec<f32>, shape: [usize; 4], dtype: DType, device: &B::Device) -> Tensor<B, 4> {
    Tensor::from_data(TensorData::new(bias, shape).convert_dtype(dtype), (device, dtype))
}

/// Prefill of `q_len` tokens after `kv_len - q_len` cached ones: each row's first `pads[row]`
/// positions are padding, hidden from every other position; a padding position still sees
/// itself so that no softmax row is empty. `None` without padding.
pub fn padding<B: Backend>(pads: &[usize], q_len: usize, kv_len: usize, dtype: DType, device: &B::Device) -> Option<Tensor<B, 4>> {
    if pads.iter().all(|&p| p == 0) {
        return None;
    }
    let mut bias = vec![0f32; pads.len() * q_len * kv_len];
    for (row, &pad) in pads.iter().enumerate() {
        for q in 0..q_len {
            let position = kv_len - q_len + q;
            for key in (0..pad.min(kv_len)).filter(|&k| k != position) {
                bias[(row * q_len + q) * kv_len + key] = f32::NEG_INFINITY;
            }
        }
    }
    Some(upload(bias, [pads.len(), 1, q_len, kv_len], dtype, device))
}

/// One decode token per row at position `len - 1` over a cache buffer of `capacity`: visible are
/// keys `pad ≤ j < len` within `window` of the token. One mask per distinct window of the layers.
pub fn decode<B: Backend>(
    pads: &[usize],
    len: usize,
    capacity: usize,
    windows: &[Option<usize>],
    dtype: DType,
    device: &B::Device,
) -> Vec<(Option<usize>, Tensor<B, 4>)> {
    let mut distinct: Vec<Option<usize>> = Vec::new();
    for w in windows {
        if !distinct.contains(w) {
            distinct.push(*w);
        }
    }
    distinct
        .into_iter()
        .map(|window| {
            let first = window.map_or(0, |w| len.saturating_sub(w));
            let mut bias = vec![f32::NEG_INFINITY; pads.len() * capacity];
            for (row, &pad) in pads.iter().enumerate() {
                bias[row * capacity + first.max(pad)..row * capacity + len].fill(0.0);
            }
            (window, upload(bias, [pads.len(), 1, 1, capacity], dtype, device))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::DType;

    fn visible(mask: burn::tensor::Tensor<NdArray, 4>) -> Vec<bool> {
        mask.into_data().to_vec::<f32>().unwrap().iter().map(|v| v.is_finite()).collect()
    }

    #[test]
    fn decode_masks_cover_padding_length_and_window() {
        let device = Default::default();
        let masks = super::decode::<NdArray>(&[0, 2], 5, 7, &[None, Some(2), None], DType::F32, &device);
        assert_eq!(masks.len(), 2);
        let full = visible(masks[0].1.clone());
        assert_eq!(&full[..7], &[true, true, true, true, true, false, false]);
        assert_eq!(&full[7..], &[false, false, true, true, true, false, false]);
        let windowed = visible(masks[1].1.clone());
        assert_eq!(&windowed[..7], &[false, false, false, true, true, false, false]);
    }

    #[test]
    fn padding_mask_hides_pads_but_keeps_rows_nonempty() {
        let device = Default::default();
        assert!(super::padding::<NdArray>(&[0, 0], 3, 3, DType::F32, &device).is_none());
        let mask = visible(super::padding::<NdArray>(&[1], 3, 3, DType::F32, &device).unwrap());
        // Row 0 (padding) sees itself; rows 1, 2 never see position 0.
        assert_eq!(mask, [true, true, true, false, true, true, false, true, true]);
    }
}
