//! The additive attention masks of the decoder: left padding of batched prompts during prefill
//! (built on the host), and the whole-buffer masks of decode steps (unwritten positions, padding,
//! the sliding window; built on the device from [`DecodeInputs`]). They are `[batch, 1, q, kv]`,
//! broadcast over heads, 0 or −∞.

use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};

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

/// Inputs of a decode step that live on the device. With them every kernel of the step and every
/// kernel argument is the same at each position (the position is data, not a launch argument), so
/// a step can be captured once and replayed (`generation::graph`).
#[derive(Debug, Clone)]
pub struct DecodeInputs<B: Backend> {
    /// `[1]`: where the step's tokens go (the cache's length before the step).
    pub position: Tensor<B, 1, Int>,
    /// `[batch]`: each row's left padding, which attention never sees.
    pub pads: Tensor<B, 1, Int>,
}

impl<B: Backend> DecodeInputs<B> {
    pub fn new(position: usize, pads: &[usize], device: &B::Device) -> Self {
        let ints = |v: Vec<i64>| {
            let n = v.len();
            Tensor::from_data(TensorData::new(v, [n]), device)
        };
        Self { position: ints(vec![position as i64]), pads: ints(pads.iter().map(|&p| p as i64).collect()) }
    }

    /// The step's additive masks over a cache of `keys` (`[1, capacity]`: `0..capacity`), built on
    /// the device: row `r` sees keys `pads[r] ≤ j ≤ position` within `window` of the position.
    /// One `[batch, 1, 1, capacity]` mask per distinct window of the layers.
    pub fn masks(&self, keys: &Tensor<B, 2, Int>, windows: &[Option<usize>], dtype: DType) -> Vec<(Option<usize>, Tensor<B, 4>)> {
        let ([batch], [_, capacity]) = (self.pads.dims(), keys.dims());
        let keys = keys.clone().expand([batch, capacity]);
        let position = self.position.clone().reshape([1, 1]).expand([batch, capacity]);
        let pads = self.pads.clone().reshape([batch, 1]).expand([batch, capacity]);
        let ahead = keys.clone().greater(position.clone());
        let mut distinct: Vec<Option<usize>> = Vec::new();
        for w in windows {
            if !distinct.contains(w) {
                distinct.push(*w);
            }
        }
        distinct
            .into_iter()
            .map(|window| {
                let first = match window {
                    Some(w) => pads.clone().max_pair(position.clone().sub_scalar(w as i64 - 1)),
                    None => pads.clone(),
                };
                let hidden = keys.clone().lower(first).bool_or(ahead.clone());
                let bias = Tensor::<B, 2>::zeros([batch, capacity], (&keys.device(), dtype)).mask_fill(hidden, f32::NEG_INFINITY);
                (window, bias.reshape([batch, 1, 1, capacity]))
            })
            .collect()
    }
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
        let keys = burn::tensor::Tensor::<NdArray, 1, burn::tensor::Int>::arange(0..7, &device).reshape([1, 7]);
        let inputs = super::DecodeInputs::<NdArray>::new(4, &[0, 2], &device);
        let masks = inputs.masks(&keys, &[None, Some(2), None], DType::F32);
        assert_eq!(masks.len(), 2);
        let full = visible(masks[0].1.clone());
        assert_eq!(&full[..7], &[true, true, true, true, true, false, false]);
        assert_eq!(&full[7..], &[false, false, true, true, true, false, false]);
        let windowed = visible(masks[1].1.clone());
        assert_eq!(&windowed[..7], &[false, false, false, true, true, false, false]);
        assert_eq!(&windowed[7..], &[false, false, false, true, true, false, false]);
        // A window wider than the context keeps the padding hidden.
        let wide = visible(inputs.masks(&keys, &[Some(6)], DType::F32)[0].1.clone());
        assert_eq!(&wide[7..], &[false, false, true, true, true, false, false]);
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
