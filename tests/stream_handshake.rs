//! The CubeCL half of the cuBLASLt stream handshake (`kiln_kernels::stream_handshake`): with its
//! *done* word already holding the nonce, the kernel must write the nonce into its slot's *ready*
//! word, leave every other word alone, and return. (The CUDA half runs in the GPU check.)

mod common;

use cubecl::prelude::*;
use cubecl::wgpu::WgpuRuntime;
use kiln_kernels::stream_handshake::{DONE, READY, SLOT_WORDS, launch_handshake};

#[test]
fn handshake_signals_ready_and_returns_once_done() {
    let Some(device) = common::wgpu_device() else { return };
    let client = WgpuRuntime::client(&device);
    let (slots, slot, nonce) = (8usize, 5usize, 0x1234_5678u32);
    let mut words = vec![7u32; slots * SLOT_WORDS];
    words[slot * SLOT_WORDS + DONE] = nonce;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let handle = client.create_from_slice(&bytes);
    // SAFETY: the buffer holds `slots × SLOT_WORDS` u32 words.
    launch_handshake(&client, unsafe { ArrayArg::from_raw_parts(handle.clone(), slots * SLOT_WORDS) }, slot as u32, nonce);
    let out = client.read_one(handle).expect("read back");
    let got: Vec<u32> = out.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    let mut expected = words.clone();
    expected[slot * SLOT_WORDS + READY] = nonce;
    assert_eq!(got, expected);
}
