//! An item (cleanup) memory for vector-symbolic architectures: labelled packed trit vectors on
//! the device, queried by exact similarity ([`TritTensor::search`]).
//!
//! Inserts are buffered on the host and uploaded as one batch at the next query (one
//! concatenation per query, not per insert); batches already on the device are appended as they
//! are. The labels stay on the host, in insertion order, so index `i` of a search names the `i`-th
//! inserted vector.

use crate::ops::trit::{Metric, TritBackend, TritError, TritTensor, TritVec};
use burn::tensor::{Int, Tensor};

/// One answer of a query: the stored vector's label, its index and its score.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match<L> {
    pub label: L,
    pub index: usize,
    /// Dot product or Hamming distance, per the memory's metric.
    pub score: i64,
}

/// Labelled trit vectors of one length on one device.
#[derive(Debug, Clone)]
pub struct ItemMemory<B: TritBackend, L> {
    len: usize,
    metric: Metric,
    device: B::Device,
    stored: Option<TritTensor<B>>,
    pending: Vec<TritVec>,
    labels: Vec<L>,
}

impl<B: TritBackend, L: Clone> ItemMemory<B, L> {
    /// An empty memory of `len`-trit vectors ranked by `metric`.
    pub fn new(len: usize, metric: Metric, device: &B::Device) -> Self {
        Self { len, metric, device: device.clone(), stored: None, pending: Vec::new(), labels: Vec::new() }
    }

    /// Number of stored vectors.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The labels in insertion order.
    pub fn labels(&self) -> &[L] {
        &self.labels
    }

    /// Store a host vector under `label`.
    pub fn insert(&mut self, label: L, vector: TritVec) -> Result<(), TritError> {
        self.check_len(vector.len())?;
        self.pending.push(vector);
        self.labels.push(label);
        Ok(())
    }

    /// Store a device batch, one label per row.
    pub fn insert_batch(&mut self, labels: Vec<L>, vectors: TritTensor<B>) -> Result<(), TritError> {
        self.check_len(vectors.len())?;
        if labels.len() != vectors.rows() {
            return Err(TritError(format!("item memory: {} labels for {} vectors", labels.len(), vectors.rows())));
        }
        self.flush();
        self.append(vectors);
        self.labels.extend(labels);
        Ok(())
    }

    /// Rows after the stored batch (or the first batch).
    fn append(&mut self, rows: TritTensor<B>) {
        self.stored = Some(match self.stored.take() {
            Some(stored) => TritTensor::cat(&[stored, rows]),
            None => rows,
        });
    }

    fn check_len(&self, len: usize) -> Result<(), TritError> {
        if len != self.len {
            return Err(TritError(format!("item memory of {}-trit vectors given a vector of {len} trits", self.len)));
        }
        Ok(())
    }

    /// Upload the buffered inserts.
    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let batch = TritTensor::from_host(&self.pending, &self.device).expect("pending vectors share the memory's length");
        self.pending.clear();
        self.append(batch);
    }

    /// The stored vectors as one device batch (uploading buffered inserts first).
    pub fn vectors(&mut self) -> Option<&TritTensor<B>> {
        self.flush();
        self.stored.as_ref()
    }

    /// For each row of `queries`, its `k` nearest stored vectors, best first (ties to the
    /// earlier insert). Reads back `rows × k` scores and indices.
    pub fn query(&mut self, queries: &TritTensor<B>, k: usize) -> Result<Vec<Vec<Match<L>>>, TritError> {
        self.check_len(queries.len())?;
        if k == 0 || k > self.len() {
            return Err(TritError(format!("item memory: k = {k} of {} stored vectors", self.len())));
        }
        self.flush();
        let stored = self.stored.as_ref().expect("a nonempty memory");
        let (scores, indices) = queries.search(stored, self.metric, k);
        let read = |t: Tensor<B, 2, Int>| -> Vec<i64> { t.into_data().convert::<i64>().into_vec().expect("int results") };
        let (scores, indices) = (read(scores), read(indices));
        let rows = scores.chunks_exact(k).zip(indices.chunks_exact(k));
        Ok(rows
            .map(|(s, i)| s.iter().zip(i).map(|(&score, &index)| Match { label: self.labels[index as usize].clone(), index: index as usize, score }).collect())
            .collect())
    }

    /// Each row of `noisy` replaced by its nearest stored vector, on the device (no read-back).
    pub fn cleanup(&mut self, noisy: &TritTensor<B>) -> Result<TritTensor<B>, TritError> {
        self.check_len(noisy.len())?;
        if self.is_empty() {
            return Err(TritError("item memory: cleanup of an empty memory".into()));
        }
        let metric = self.metric;
        let stored = self.vectors().expect("a nonempty memory");
        let (_, indices) = noisy.search(stored, metric, 1);
        let rows = noisy.rows();
        Ok(stored.select(indices.reshape([rows])))
    }
}
