//! Packed trit vectors (`kiln::ops::trit`): conversion, generation, the algebra (bind, permute,
//! bundle) and similarity search, on words laid out as the host definition documents
//! (`kiln::ops::trit::format`): per 32 trits a pair of u32 words, the plus plane then the minus
//! plane, rows of `pairs` pairs back to back, bits past the length zero.
//!
//! Every kernel works in integers, so each path gives the host definition's results exactly.

mod elementwise;
mod search;
#[cfg(feature = "cuda")]
pub mod scores_mma;

pub use elementwise::{launch_bind, launch_bundle, launch_pack, launch_permute, launch_planes_to_codes, launch_random, launch_unpack, BundleArgs};
pub use search::{launch_scores, launch_topk, Metric, ScoreArgs, TopkArgs, WordLayout, TOPK_CHUNK, TOPK_MAX_K};

use cubecl::prelude::*;

/// Trits per word.
pub const TRITS_PER_WORD: usize = 32;

/// One round of the 32-bit "lowbias32" integer hash (the host's `mix32`).
#[cube]
pub(crate) fn mix32(x: u32) -> u32 {
    let mut x = x;
    x ^= x >> 16u32;
    x *= 0x7feb_352du32;
    x ^= x >> 15u32;
    x *= 0x846c_a68bu32;
    x ^ (x >> 16u32)
}

/// The mask of the valid bits of word pair `w` of a vector of `len` trits.
#[cube]
pub(crate) fn valid_bits(len: usize, w: usize) -> u32 {
    let rest = len - w * TRITS_PER_WORD;
    let mut mask = u32::MAX.runtime();
    if rest < TRITS_PER_WORD {
        mask = (1u32 << rest as u32) - 1u32;
    }
    mask
}
