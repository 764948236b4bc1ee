//! A device-side handshake between a CubeCL stream and a foreign CUDA stream (cuBLASLt's).
//!
//! CubeCL 0.10 does not expose the `CUstream` it launches on, so work enqueued on another stream
//! cannot be ordered against it with events. Instead both sides meet in device memory, with no
//! host synchronization. Each handshake has a slot (two words) in a persistent flag buffer that
//! only handshakes ever write, and a nonce that no earlier handshake of that slot used:
//!
//! 1. CubeCL's stream runs [`handshake_kernel`], which stores the nonce into the slot's *ready*
//!    word (everything enqueued before it on CubeCL's stream has finished, so the foreign stream
//!    may read those results) and spins until the slot's *done* word holds the nonce.
//! 2. The foreign stream runs a one-thread kernel that spins until *ready* holds the nonce, then
//!    its work, then a one-thread kernel that writes the nonce into *done* (its own kernels: those
//!    live with the foreign stream's owner, which compiles them for its API).
//!
//! Everything CubeCL enqueues later runs after the kernel returns, hence after the foreign work.
//! Stale words can never match: they hold older nonces of the same buffer. The host side must
//! not reuse a slot while its previous handshake is still pending.

use cubecl::prelude::*;

/// Words per slot: *ready* then *done*.
pub const SLOT_WORDS: usize = 2;
/// Offset of the word the CubeCL side sets when its earlier work has finished.
pub const READY: usize = 0;
/// Offset of the word the foreign stream sets when its work has finished.
pub const DONE: usize = 1;

/// One unit: signal *ready*, then wait for *done*. Atomics compile to L2 operations on CUDA, so
/// the spin sees the foreign stream's write and is not hoisted out of the loop.
#[cube(launch)]
pub fn handshake_kernel(flags: &Array<Atomic<u32>>, slot: u32, nonce: u32) {
    let base = slot as usize * SLOT_WORDS;
    flags[base + READY].store(nonce);
    loop {
        if flags[base + DONE].load() == nonce {
            break;
        }
    }
}

/// Enqueue the CubeCL half of handshake `nonce` in `slot` on `client`'s stream. `flags` is the
/// persistent buffer of `slots × SLOT_WORDS` words.
pub fn launch_handshake<R: Runtime>(client: &ComputeClient<R>, flags: ArrayArg<R>, slot: u32, nonce: u32) {
    handshake_kernel::launch::<R>(client, CubeCount::Static(1, 1, 1), CubeDim::new_single(), flags, slot, nonce)
}
