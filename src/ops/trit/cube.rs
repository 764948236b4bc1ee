//! Packed trits on CubeCL backends: shape bookkeeping and allocation around
//! `kiln_kernels::trit`. Words are i32 tensors here (the kernels bind them as u32).

use burn::tensor::{DType, IntDType, Shape, TensorData, TensorMetadata, ops::{IntTensor, IntTensorOps}};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor};
use kiln_kernels::trit::{self as kernels, BundleArgs, Metric, ScoreArgs, TOPK_CHUNK, TOPK_MAX_K, TopkArgs, WordLayout};

use super::{TritBackend, reference, words_shape};
use crate::backend::cube::{dense, empty_like_device, storage};

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// The words dense and 32-bit (a cast keeps the low 32 bits of wider ints).
fn words32<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(words: CubeTensor<R>) -> CubeTensor<R> {
    let words = dense(words);
    match words.dtype {
        DType::I32 | DType::U32 => words,
        _ => Cube::<R, F, I, BT>::int_cast(words, IntDType::I32),
    }
}

/// Words per vector load: four (two pairs) when a row's words allow, else one pair.
fn vector_size(width: usize) -> usize {
    if width.is_multiple_of(4) { 4 } else { 2 }
}

fn rows_width<R: CubeRuntime>(t: &CubeTensor<R>) -> (usize, usize) {
    let shape = t.shape();
    (shape[0], shape[1])
}

/// Host i32 values as a device tensor like `like`.
fn host_ints<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(values: Vec<i32>, device: &R::Device) -> CubeTensor<R> {
    let n = values.len();
    Cube::<R, F, I, BT>::int_from_data(TensorData::new(values, [n]), device)
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> TritBackend for CubeBackend<R, F, I, BT> {
    fn trit_pack(trits: IntTensor<Self>) -> IntTensor<Self> {
        let trits = dense(trits);
        let (rows, len) = rows_width(&trits);
        let words = empty_like_device(&trits, words_shape(rows, len), DType::I32);
        kernels::launch_pack(&trits.client.clone(), storage(&trits), rows, len, trits.into_array_arg(), words.clone().into_array_arg());
        words
    }

    fn trit_unpack(words: IntTensor<Self>, len: usize) -> IntTensor<Self> {
        let words = words32::<R, F, I, BT>(words);
        let rows = words.shape()[0];
        let trits = empty_like_device(&words, [rows, len], I::dtype());
        kernels::launch_unpack(&words.client.clone(), storage(&trits), rows, len, words.into_array_arg(), trits.clone().into_array_arg());
        trits
    }

    fn trit_random(rows: usize, len: usize, seed: u64, threshold: u32, device: &Self::Device) -> IntTensor<Self> {
        let client = R::client(device);
        let words = empty_device_contiguous_dtype(client.clone(), device.clone(), words_shape(rows, len), DType::I32);
        kernels::launch_random(&client, rows, len, seed, threshold, 0, words.clone().into_array_arg());
        words
    }

    fn trit_bind(a: IntTensor<Self>, b: IntTensor<Self>) -> IntTensor<Self> {
        let (a, b) = (words32::<R, F, I, BT>(a), words32::<R, F, I, BT>(b));
        let (rows, width) = rows_width(&a);
        let out = empty_like_device(&a, a.shape(), DType::I32);
        let b_words = b.shape().num_elements();
        kernels::launch_bind(&a.client.clone(), rows * width, b_words, vector_size(width), a.into_array_arg(), b.into_array_arg(), out.clone().into_array_arg());
        out
    }

    fn trit_permute(words: IntTensor<Self>, len: usize, shift: usize) -> IntTensor<Self> {
        let words = words32::<R, F, I, BT>(words);
        let rows = words.shape()[0];
        let out = empty_like_device(&words, words.shape(), DType::I32);
        kernels::launch_permute(&words.client.clone(), rows, len, shift, words.into_array_arg(), out.clone().into_array_arg());
        out
    }

    fn trit_bundle(words: IntTensor<Self>, len: usize, weights: Option<Vec<i32>>) -> IntTensor<Self> {
        let words = words32::<R, F, I, BT>(words);
        let (rows, width) = rows_width(&words);
        let pairs = width / 2;
        let client = words.client.clone();
        let chunks = BundleArgs::<R>::chunks(&client, rows, pairs);
        let sums = empty_like_device(&words, [chunks * pairs * kernels::TRITS_PER_WORD], DType::I32);
        let out = empty_like_device(&words, words_shape(1, len), DType::I32);
        let weighted = weights.is_some();
        // Unweighted, the kernel never reads the weights: the words stand in for the binding.
        let weights = weights.map(|w| host_ints::<R, F, I, BT>(w, &words.device)).unwrap_or_else(|| words.clone());
        let args = BundleArgs {
            words: words.into_array_arg(),
            weights: weights.into_array_arg(),
            weighted,
            sums: (sums.clone().into_array_arg(), sums.into_array_arg()),
            out: out.clone().into_array_arg(),
        };
        kernels::launch_bundle(&client, rows, pairs, args);
        out
    }

    fn trit_scores(queries: IntTensor<Self>, memory: IntTensor<Self>, metric: Metric, pairwise: bool) -> IntTensor<Self> {
        let (queries, memory) = (words32::<R, F, I, BT>(queries), words32::<R, F, I, BT>(memory));
        let ((query_rows, width), memory_rows) = (rows_width(&queries), memory.shape()[0]);
        let shape: Shape = if pairwise { [memory_rows].into() } else { [query_rows, memory_rows].into() };
        if width == 0 {
            return Self::int_zeros(shape, &memory.device, IntDType::I32);
        }
        let scores = empty_like_device(&memory, shape, DType::I32);
        #[cfg(feature = "cuda")]
        if !pairwise && mma::scores(&queries, &memory, &scores, metric) {
            return scores;
        }
        let vector_size = vector_size(width);
        let args = ScoreArgs {
            queries: queries.into_array_arg(),
            memory: memory.clone().into_array_arg(),
            scores: scores.clone().into_array_arg(),
            query_rows,
            memory_rows,
            vectors: width / vector_size,
            vector_size,
            metric,
            pairwise,
            layout: WordLayout::Planes,
        };
        kernels::launch_scores(&memory.client, args);
        scores
    }

    fn trit_topk(scores: IntTensor<Self>, k: usize, smallest: bool) -> (IntTensor<Self>, IntTensor<Self>) {
        if k > TOPK_MAX_K {
            return reference::topk::<Self>(scores, k, smallest);
        }
        let scores = words32::<R, F, I, BT>(scores);
        let (rows, mut n) = rows_width(&scores);
        let client = scores.client.clone();
        let (mut keys, mut indices): (CubeTensor<R>, Option<CubeTensor<R>>) = (scores, None);
        // Each pass keeps the k best of every chunk of TOPK_CHUNK, until one chunk remains.
        loop {
            let chunks = n.div_ceil(TOPK_CHUNK);
            let out_keys = empty_like_device(&keys, [rows, chunks * k], DType::I32);
            let out_indices = empty_like_device(&keys, [rows, chunks * k], DType::I32);
            let args = TopkArgs {
                keys: keys.clone().into_array_arg(),
                indices: indices.clone().unwrap_or_else(|| keys.clone()).into_array_arg(),
                explicit: indices.is_some(),
                out_keys: out_keys.clone().into_array_arg(),
                out_indices: out_indices.clone().into_array_arg(),
            };
            kernels::launch_topk(&client, rows, n, k, smallest, args);
            (keys, indices, n) = (out_keys, Some(out_indices), chunks * k);
            if chunks == 1 {
                break;
            }
        }
        (keys, indices.expect("one pass ran"))
    }
}

/// All-pairs scores on CUDA's binary tensor cores (`kiln_kernels::trit::scores_mma`).
#[cfg(feature = "cuda")]
mod mma {
    use burn::tensor::{DType, TensorMetadata};
    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
    use kiln_kernels::trit::Metric;
    use kiln_kernels::trit::scores_mma::{MmaScoreArgs, launch_scores_mma, prepared_words, takes};

    use super::rows_width;
    use crate::backend::cube::cuda::{self, binding};
    use crate::backend::cube::empty_like_device;

    /// Enqueues `scores` (all pairs) on the tensor cores if the words live on a CUDA device of
    /// compute capability 8.0 or up (1-bit `mma`) and the kernel takes the sizes; `false`
    /// enqueues nothing.
    pub(super) fn scores<R: CubeRuntime>(queries: &CubeTensor<R>, memory: &CubeTensor<R>, scores: &CubeTensor<R>, metric: Metric) -> bool {
        let Some(client) = cuda::client(memory) else { return false };
        let ((query_rows, width), memory_rows) = (rows_width(queries), memory.shape()[0]);
        let pairs = width / 2;
        let capable = cuda::capable(memory, (8, 0));
        if !capable || !takes(query_rows, memory_rows, pairs) {
            return false;
        }
        let prepared = empty_like_device(memory, [prepared_words(query_rows, pairs)], DType::I32);
        let nnz = empty_like_device(memory, [query_rows], DType::I32);
        let args = MmaScoreArgs { queries: binding(queries), memory: binding(memory), scores: binding(scores), prepared: binding(&prepared), nnz: binding(&nnz) };
        launch_scores_mma(client, query_rows, memory_rows, pairs, metric, args);
        true
    }
}
