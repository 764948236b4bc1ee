//! Optimizers built on kiln's ops.

mod sketched_adamw;

pub use sketched_adamw::{SketchedAdamW, SketchedAdamWConfig, SketchedAdamWState};
