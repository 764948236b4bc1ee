//! Sketches under `Autodiff<B>`: an optimizer's transform, never differentiated, so the inner
//! backend's result comes back untracked.

use burn::backend::autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};
use burn::tensor::{FloatDType, backend::AutodiffBackend, ops::FloatTensor};

use super::{AdamWScalars, Sketch, SketchBackend};

impl<B: SketchBackend, C: CheckpointStrategy> SketchBackend for Autodiff<B, C> {
    fn sketch_compress(g: FloatTensor<Self>, sketch: Sketch, squares: bool) -> FloatTensor<Self> {
        Self::from_inner(B::sketch_compress(Self::inner(g), sketch, squares))
    }

    fn sketch_decompress(c: FloatTensor<Self>, sketch: Sketch, signed: bool, dtype: FloatDType) -> FloatTensor<Self> {
        Self::from_inner(B::sketch_decompress(Self::inner(c), sketch, signed, dtype))
    }

    fn sketch_adamw_step(param: FloatTensor<Self>, grad: FloatTensor<Self>, moments: [FloatTensor<Self>; 2], sketch: Sketch, scalars: AdamWScalars) -> [FloatTensor<Self>; 3] {
        B::sketch_adamw_step(Self::inner(param), Self::inner(grad), moments.map(Self::inner), sketch, scalars).map(Self::from_inner)
    }
}
