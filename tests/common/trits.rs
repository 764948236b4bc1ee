//! The device side of the trit checks, shared by the CI tests (wgpu, NdArray) and the GPU check
//! (CUDA): every op against the host definition (`kiln::ops::trit::format`) with integer
//! equality, outputs poisoned first.

use burn::tensor::{Int, Tensor};
use kiln::ops::trit::{Metric, TritBackend, TritTensor, TritVec, format};

/// Fill the device's pool with all-ones words (a trit with both planes set), so that a word no
/// kernel writes fails the layout check of `to_host`.
pub fn poison<B: TritBackend>(device: &B::Device, words: usize) {
    let t: Tensor<B, 1, Int> = Tensor::full([words.max(1)], -1, device);
    let _ = t.into_data();
}

pub fn host_batch(rows: usize, len: usize, density: f64, seed: u64) -> Vec<TritVec> {
    (0..rows as u32).map(|r| TritVec::random(len, density, seed, r).unwrap()).collect()
}

pub fn ints<B: TritBackend, const D: usize>(t: Tensor<B, D, Int>) -> Vec<i64> {
    t.into_data().convert::<i64>().into_vec().unwrap()
}

/// Every op on `rows` random rows of each length, against the host definition.
pub fn check_ops<B: TritBackend>(device: &B::Device, lengths: &[usize], rows: usize) {
    for &len in lengths {
        let ctx = format!("len {len}");
        poison::<B>(device, 8 * rows * 2 * format::word_pairs(len));
        let a = TritTensor::<B>::random(rows, len, 0.4, 11, device).unwrap();
        let ha = host_batch(rows, len, 0.4, 11);
        assert_eq!(a.to_host(), ha, "{ctx}: random");
        let hb = host_batch(rows, len, 1.0, 12);
        let b = TritTensor::<B>::from_host(&hb, device).unwrap();

        let unpacked = a.to_int();
        assert_eq!(ints(unpacked.clone()), ha.iter().flat_map(|v| v.to_i8()).map(i64::from).collect::<Vec<_>>(), "{ctx}: to_int");
        assert_eq!(TritTensor::<B>::from_int(unpacked * 3).to_host(), ha, "{ctx}: from_int keeps signs");

        let bound: Vec<TritVec> = ha.iter().zip(&hb).map(|(x, y)| x.bind(y)).collect();
        assert_eq!(a.bind(&b).to_host(), bound, "{ctx}: bind");
        let key = b.slice(0..1);
        assert_eq!(a.bind(&key).unbind(&key).to_host(), ha, "{ctx}: unbind by a dense key");

        for shift in [1, -1, 31, 32, 33, len as i64 - 1, 3 * len as i64 + 5, -(len as i64) - 7] {
            let expected: Vec<TritVec> = ha.iter().map(|v| v.permute(shift)).collect();
            assert_eq!(a.permute(shift).to_host(), expected, "{ctx}: permute {shift}");
        }

        let refs: Vec<&TritVec> = ha.iter().collect();
        assert_eq!(a.bundle().to_host(), vec![TritVec::bundle(&refs)], "{ctx}: bundle");
        let weights: Vec<i32> = (0..rows as i32).map(|i| (i % 5) - 2).collect();
        assert_eq!(a.bundle_weighted(&weights).to_host(), vec![TritVec::bundle_weighted(&refs, &weights)], "{ctx}: weighted bundle");

        let dots: Vec<i64> = ha.iter().zip(&hb).map(|(x, y)| x.dot(y)).collect();
        assert_eq!(ints(a.dot(&b)), dots, "{ctx}: dot");
        assert_eq!(ints(a.hamming(&b)), ha.iter().zip(&hb).map(|(x, y)| x.hamming(y)).collect::<Vec<_>>(), "{ctx}: hamming");
        assert_eq!(ints(a.nnz()), ha.iter().map(TritVec::nnz).collect::<Vec<_>>(), "{ctx}: nnz");
        assert_eq!(ints(a.dot(&key)), ha.iter().map(|x| x.dot(&hb[0])).collect::<Vec<_>>(), "{ctx}: dot against one row");
        let cosines: Vec<f32> = a.cosine(&b).into_data().convert::<f32>().into_vec().unwrap();
        for (c, (x, y)) in cosines.iter().zip(ha.iter().zip(&hb)) {
            assert!((*c as f64 - x.cosine(y)).abs() <= 2e-7 * x.cosine(y).abs().max(1e-3), "{ctx}: cosine {c} vs {}", x.cosine(y));
        }
        check_search::<B>(&a, &ha, &b.slice(0..2.min(rows)), &hb[..2.min(rows)], &ctx);
    }
}

/// Search with both metrics against the host's, every score row too.
pub fn check_search<B: TritBackend>(memory: &TritTensor<B>, hm: &[TritVec], queries: &TritTensor<B>, hq: &[TritVec], ctx: &str) {
    for metric in [Metric::Dot, Metric::Hamming] {
        let expected_scores: Vec<i64> = hq
            .iter()
            .flat_map(|q| hm.iter().map(move |m| if metric == Metric::Dot { q.dot(m) } else { q.hamming(m) }))
            .collect();
        assert_eq!(ints(queries.similarity(memory, metric)), expected_scores, "{ctx}: {metric:?} scores");
        for k in [1, 3.min(hm.len()), hm.len()] {
            let (scores, indices) = queries.search(memory, metric, k);
            let (scores, indices) = (ints(scores), ints(indices));
            for (q, query) in hq.iter().enumerate() {
                let best = format::search(query, hm, metric, k);
                let got: Vec<(usize, i64)> = (0..k).map(|j| (indices[q * k + j] as usize, scores[q * k + j])).collect();
                assert_eq!(got, best, "{ctx}: {metric:?} top-{k} of query {q}");
            }
        }
    }
}
