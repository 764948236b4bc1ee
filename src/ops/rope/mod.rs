//! Rotary position embedding in the HF "rotate half" layout used by Llama and Qwen checkpoints
//! (not Burn's `RotaryEncoding`, which rotates interleaved pairs).

mod backward;
mod cube;
mod fusion;
pub mod reference;
mod table;

pub use table::{RopeScaling, RopeTable};

use burn::tensor::{Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::{prim, wrap};
use crate::error::{ensure, ensure_float};

/// Backend support for RoPE. The default methods are the reference implementation.
pub trait RopeBackend: Backend {
    /// Rotate `x: [batch, seq, heads, head_dim]` by the angles of positions
    /// `offset..offset + seq` from f32 tables `cos`/`sin: [positions, head_dim/2]`; `inverse`
    /// rotates the other way (the backward). The output is contiguous.
    fn rope_forward(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        offset: usize,
        inverse: bool,
    ) -> FloatTensor<Self> {
        reference::rotate::<Self>(x, cos, sin, offset, inverse)
    }
}

crate::backend::reference_backends!(RopeBackend);

/// Apply rotary embeddings to `x: [batch, seq, heads, head_dim]` at positions
/// `offset..offset + seq` (pass the KV-cache length as `offset` when decoding).
///
/// A `[batch, heads, seq, head_dim]` tensor goes in as `x.swap_dims(1, 2)`; only the last axis
/// must be contiguous, so that costs no copy.
///
/// # Panics
/// If `head_dim` differs from the table's, or positions run past the table.
pub fn rope<B: RopeBackend>(x: Tensor<B, 4>, table: &RopeTable<B>, offset: usize) -> Tensor<B, 4> {
    let x = prim(x);
    validate_heads::<B>("rope", &x, table, offset);
    wrap(B::rope_forward(x, prim(table.cos()), prim(table.sin()), offset, false))
}

/// Check a `[batch, seq, heads, head_dim]` input against a table.
pub(crate) fn validate_heads<B: Backend>(op: &str, x: &FloatTensor<B>, table: &RopeTable<B>, offset: usize) {
    let shape = x.shape();
    ensure_float(op, "x", x.dtype());
    ensure(shape[3] == table.head_dim(), op, || {
        format!("x [batch, seq, heads, head_dim] = {:?} has head_dim {}; the rope table was built for {}", shape.as_slice(), shape[3], table.head_dim())
    });
    ensure(offset + shape[1] <= table.max_positions(), op, || {
        format!("positions {offset}..{} of x {:?} exceed the rope table's {} positions", offset + shape[1], shape.as_slice(), table.max_positions())
    });
    // The kernels launch one cube per token on a (seq, batch) grid.
    ensure(shape[1] < 1 << 31 && shape[0] < 1 << 16, op, || {
        format!("x {:?}: seq must be below 2^31 and batch below 65536", shape.as_slice())
    });
}
