//! Packed trit vectors: the host definition against naive integer arithmetic and its algebraic
//! laws (proptest), then every device op against the host definition with integer equality, on
//! wgpu (CubeCL kernels through fusion) and NdArray (the reference in Burn ops).

use crate::common;

use burn::backend::{Autodiff, NdArray, Wgpu};
use burn::tensor::{Tensor, TensorData};
use common::trits::{check_ops, host_batch, ints};
use kiln::ops::trit::{Metric, TritTensor, TritVec, format};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// The host definition.

fn trits(max_len: usize) -> impl Strategy<Value = Vec<i8>> {
    prop::collection::vec(-1i8..=1, 1..max_len)
}

fn pair(max_len: usize) -> impl Strategy<Value = (Vec<i8>, Vec<i8>)> {
    (1..max_len).prop_flat_map(|n| (prop::collection::vec(-1i8..=1, n), prop::collection::vec(-1i8..=1, n)))
}

fn vec_of(t: &[i8]) -> TritVec {
    TritVec::from_i8(t).expect("trits")
}

proptest! {
    #[test]
    fn packed_ops_match_integer_arithmetic((a, b) in pair(150), shift in -400i64..400) {
        let (va, vb) = (vec_of(&a), vec_of(&b));
        prop_assert_eq!(va.to_i8(), a.clone());
        let product: Vec<i8> = a.iter().zip(&b).map(|(x, y)| x * y).collect();
        prop_assert_eq!(va.bind(&vb).to_i8(), product);
        prop_assert_eq!(va.dot(&vb), a.iter().zip(&b).map(|(x, y)| (*x as i64) * (*y as i64)).sum::<i64>());
        prop_assert_eq!(va.hamming(&vb), a.iter().zip(&b).filter(|(x, y)| x != y).count() as i64);
        prop_assert_eq!(va.nnz(), a.iter().filter(|x| **x != 0).count() as i64);
        let n = a.len() as i64;
        let mut rolled = vec![0i8; a.len()];
        for (i, t) in a.iter().enumerate() {
            rolled[((i as i64 + shift).rem_euclid(n)) as usize] = *t;
        }
        prop_assert_eq!(va.permute(shift).to_i8(), rolled);
        let sums: Vec<i8> = a.iter().zip(&b).map(|(x, y)| (2 * x - y).signum()).collect();
        prop_assert_eq!(TritVec::bundle_weighted(&[&va, &vb], &[2, -1]).to_i8(), sums);
    }

    #[test]
    fn bind_commutes_and_undoes_itself_with_a_nonzero_key(a in trits(200), seed in any::<u64>()) {
        let va = vec_of(&a);
        let key = TritVec::random(a.len(), 1.0, seed, 0).unwrap();
        prop_assert_eq!(va.bind(&key), key.bind(&va));
        prop_assert_eq!(va.bind(&key).unbind(&key), va);
    }

    #[test]
    fn bundle_keeps_the_majority((a, b) in pair(200)) {
        let (va, vb) = (vec_of(&a), vec_of(&b));
        let bundled = TritVec::bundle(&[&va, &vb, &va]);
        for i in 0..a.len() {
            prop_assert_eq!(bundled.get(i), if a[i] != 0 { a[i] } else { b[i] });
        }
        prop_assert_eq!(TritVec::bundle(&[&va, &va.bind(&TritVec::from_i8(&vec![-1; a.len()]).unwrap())]), TritVec::zeros(a.len()));
    }

    #[test]
    fn permute_inverts_and_composes(a in trits(300), s in -1000i64..1000, t in -1000i64..1000) {
        let va = vec_of(&a);
        prop_assert_eq!(va.permute(s).permute(-s), va.clone());
        prop_assert_eq!(va.permute(s).permute(t), va.permute(s + t));
    }

    #[test]
    fn similarities_stay_in_bounds((a, b) in pair(200)) {
        let (va, vb) = (vec_of(&a), vec_of(&b));
        prop_assert!(va.dot(&vb).abs() <= va.nnz().min(vb.nnz()));
        prop_assert!((0..=a.len() as i64).contains(&va.hamming(&vb)));
        prop_assert!(va.cosine(&vb).abs() <= 1.0 + 1e-12);
        prop_assert_eq!(va.dot(&va), va.nnz());
        prop_assert_eq!(va.hamming(&va), 0);
        prop_assert_eq!(va.cosine(&va), if va.nnz() > 0 { 1.0 } else { 0.0 });
    }

    #[test]
    fn serde_round_trips(a in trits(100)) {
        let va = vec_of(&a);
        let json = serde_json::to_string(&va).unwrap();
        prop_assert_eq!(serde_json::from_str::<TritVec>(&json).unwrap(), va);
    }
}

#[test]
fn random_vectors_have_the_asked_density_and_balance() {
    let v = TritVec::random(200_000, 0.25, 7, 3).unwrap();
    let (nnz, sum) = (v.nnz() as f64, v.to_i8().iter().map(|&t| t as f64).sum::<f64>());
    assert!((nnz / 200_000.0 - 0.25).abs() < 0.005, "density {}", nnz / 200_000.0);
    assert!(sum.abs() < 5.0 * nnz.sqrt(), "sum {sum} of {nnz} signs");
    assert_eq!(TritVec::random(200_000, 1.0, 7, 3).unwrap().nnz(), 200_000);
    assert_ne!(TritVec::random(64, 0.5, 7, 3).unwrap(), TritVec::random(64, 0.5, 7, 4).unwrap());
}

#[test]
fn bad_host_input_gives_clear_errors() {
    let e = TritVec::from_i8(&[1, 0, 2]).unwrap_err().to_string();
    assert!(e.contains("element 2") && e.contains("not a trit"), "{e}");
    for density in [0.0, -0.5, 1.5, f64::NAN] {
        let e = TritVec::random(10, density, 1, 0).unwrap_err().to_string();
        assert!(e.contains("density"), "{e}");
    }
    let e = TritVec::from_words(40, vec![1, 1, 0, 0]).unwrap_err().to_string();
    assert!(e.contains("both planes"), "{e}");
    let e = TritVec::from_words(40, vec![0, 0, 1 << 9, 0]).unwrap_err().to_string();
    assert!(e.contains("past the length"), "{e}");
    let e = TritVec::from_words(40, vec![0; 2]).unwrap_err().to_string();
    assert!(e.contains("take 4 words"), "{e}");
    assert!(serde_json::from_str::<TritVec>(r#"{"len":3,"words":[1,1]}"#).is_err());
    let msg = common::panic_message(|| TritVec::zeros(3).bind(&TritVec::zeros(4)));
    assert!(msg.contains("trit::bind") && msg.contains("3 and 4"), "{msg}");
    let msg = common::panic_message(|| TritVec::bundle(&[]));
    assert!(msg.contains("nothing to bundle"), "{msg}");
    let msg = common::panic_message(|| TritVec::bundle_weighted(&[&TritVec::zeros(3)], &[1, 1]));
    assert!(msg.contains("2 weights for 1 vectors"), "{msg}");
}

// ---------------------------------------------------------------------------------------------
// The device paths against the host definition.

#[test]
fn ops_match_the_host_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    check_ops::<Wgpu>(&device, &[1, 31, 32, 33, 1000, 65_537, 1_000_003], 5);
    // Odd row counts and many rows: multi-chunk bundles.
    check_ops::<Wgpu>(&device, &[33, 257], 301);
}

#[test]
fn ops_run_through_autodiff_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    check_ops::<Autodiff<Wgpu>>(&device, &[70], 3);
}

#[test]
fn reference_matches_the_host_on_ndarray() {
    check_ops::<NdArray>(&Default::default(), &[1, 31, 32, 33, 1000], 4);
}

/// Top-k over several kernel passes (more than one chunk of 2048), with many ties (short
/// vectors), k past the kernel's limit (the host fallback), and a million stored vectors.
#[test]
fn search_matches_the_host_over_many_vectors_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    for (rows, len, ks) in [(5000, 20, vec![1, 10, 300]), (1_000_000, 40, vec![5])] {
        let hm = host_batch(rows, len, 0.7, 21);
        let memory = TritTensor::<Wgpu>::random(rows, len, 0.7, 21, &device).unwrap();
        let hq = host_batch(3, len, 0.7, 22);
        let queries = TritTensor::<Wgpu>::from_host(&hq, &device).unwrap();
        for k in ks {
            for metric in [Metric::Dot, Metric::Hamming] {
                let (scores, indices) = queries.search(&memory, metric, k);
                let (scores, indices) = (ints(scores), ints(indices));
                for (q, query) in hq.iter().enumerate() {
                    let best = format::search(query, &hm, metric, k);
                    let got: Vec<(usize, i64)> = (0..k).map(|j| (indices[q * k + j] as usize, scores[q * k + j])).collect();
                    assert_eq!(got, best, "{rows} × {len}: {metric:?} top-{k} of query {q}");
                }
            }
        }
    }
}

#[test]
fn device_conversions_and_bad_input() {
    let device = Default::default();
    let x = Tensor::<NdArray, 2>::from_data(TensorData::new(vec![0.5f32, -0.05, -2.0, 0.1, 0.0, 3.0], [2, 3]), &device);
    let t = TritTensor::<NdArray>::from_float(x, 0.1);
    assert_eq!(t.to_host(), vec![vec_of(&[1, 0, -1]), vec_of(&[0, 0, 1])]);
    assert_eq!(t.to_float().into_data().convert::<f32>().into_vec::<f32>().unwrap(), vec![1.0, 0.0, -1.0, 0.0, 0.0, 1.0]);
    assert_eq!(t.rows(), 2);
    assert_eq!(t.bytes(), 2 * 2 * 4);
    assert_eq!(TritTensor::cat(&[t.clone(), t.slice(1..2)]).to_host()[2], vec_of(&[0, 0, 1]));

    let e = TritTensor::<NdArray>::from_host(&[TritVec::zeros(3), TritVec::zeros(4)], &device).unwrap_err().to_string();
    assert!(e.contains("3 and 4"), "{e}");
    assert!(TritTensor::<NdArray>::random(2, 10, 0.0, 1, &device).unwrap_err().to_string().contains("density"));
    let (a, b) = (TritTensor::<NdArray>::random(3, 40, 0.5, 1, &device).unwrap(), TritTensor::<NdArray>::random(2, 40, 0.5, 2, &device).unwrap());
    let msg = common::panic_message(|| a.bind(&b));
    assert!(msg.contains("trit::bind") && msg.contains("3 rows against 2 rows"), "{msg}");
    let c = TritTensor::<NdArray>::random(3, 41, 0.5, 1, &device).unwrap();
    let msg = common::panic_message(|| a.dot(&c));
    assert!(msg.contains("trit::dot") && msg.contains("40 and 41"), "{msg}");
    let msg = common::panic_message(|| b.search(&a, Metric::Dot, 4));
    assert!(msg.contains("trit::search") && msg.contains("k = 4 of 3"), "{msg}");
    let msg = common::panic_message(|| a.bundle_weighted(&[1, 2]));
    assert!(msg.contains("2 weights for 3 vectors"), "{msg}");
}

/// A noisy copy of each stored vector (a quarter of its trits replaced) finds its own label
/// first, and cleanup returns the stored vector itself.
fn check_item_memory<B: kiln::ops::trit::TritBackend>(device: &B::Device) {
    use kiln::nn::ItemMemory;
    let (len, items) = (1000, 120);
    let stored = host_batch(items, len, 1.0, 31);
    let mut memory = ItemMemory::<B, String>::new(len, Metric::Dot, device);
    for (i, v) in stored.iter().take(100).enumerate() {
        memory.insert(format!("item {i}"), v.clone()).unwrap();
    }
    let rest = TritTensor::<B>::from_host(&stored[100..], device).unwrap();
    memory.insert_batch((100..items).map(|i| format!("item {i}")).collect(), rest).unwrap();
    assert_eq!(memory.len(), items);
    let noise = host_batch(items, len, 0.25, 32);
    let noisy: Vec<TritVec> = stored
        .iter()
        .zip(&noise)
        .map(|(v, n)| TritVec::from_i8(&v.to_i8().iter().zip(n.to_i8()).map(|(&a, b)| if b != 0 { b } else { a }).collect::<Vec<_>>()).unwrap())
        .collect();
    let queries = TritTensor::<B>::from_host(&noisy, device).unwrap();
    let answers = memory.query(&queries, 3).unwrap();
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(answer[0].label, format!("item {i}"), "query {i}: {answer:?}");
        assert_eq!(answer[0].score, noisy[i].dot(&stored[i]));
        assert!(answer[0].score >= answer[1].score && answer[1].score >= answer[2].score);
    }
    assert_eq!(memory.cleanup(&queries).unwrap().to_host(), stored);
    let short = TritTensor::<B>::from_host(&[TritVec::zeros(999)], device).unwrap();
    assert!(memory.query(&short, 1).unwrap_err().to_string().contains("1000-trit vectors given a vector of 999"));
    assert!(memory.query(&queries, items + 1).unwrap_err().to_string().contains("k = 121 of 120"));
    assert!(memory.insert("x".into(), TritVec::zeros(5)).is_err());
}

#[test]
fn item_memory_recalls_noisy_items_on_wgpu() {
    let Some(device) = common::wgpu_device() else { return };
    check_item_memory::<Wgpu>(&device);
}

#[test]
fn item_memory_recalls_noisy_items_on_ndarray() {
    check_item_memory::<NdArray>(&Default::default());
}
