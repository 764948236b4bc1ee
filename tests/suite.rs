//! Every kiln integration test in one binary: each op's tests stay in their own file
//! (`tests/<op>.rs`), and this file only gathers them, because each test binary links Burn,
//! CubeCL, wgpu and cudarc and monomorphizes the shared parity harness again, which made linking
//! and codegen most of CI's build time. Run one op's tests with a filter:
//! `cargo test --features cuda --test suite nf4::`.
//!
//! One process holds every test, so process-wide state is shared. Burn 0.21 keeps one default
//! float dtype per device type, set by the first backend that asks (`get_device_settings`):
//! `NdArray<f32>` and the oracle's `NdArray<f64>` share `NdArrayDevice::Cpu`. The parity checks
//! give every tensor its dtype; a few tests here still build `NdArray` tensors with the default
//! (`Tensor::ones` in the bad-input tests), which is f32 only because the first tests to start
//! (dora's, on NdArray) ask first. kiln-models' tests lean on the default throughout (its f32 and
//! f64 model tests raced for it when gathered like this, thirty-second session) and stay one
//! binary per file.

mod common;
mod cross_entropy;
mod dora;
mod flash_attention;
mod linear_cross_entropy;
mod lora;
mod matmul;
mod nf4;
mod rms_norm;
mod rms_norm_rope;
mod rope;
mod sketch;
mod swiglu;
mod ternary;
mod trit;
