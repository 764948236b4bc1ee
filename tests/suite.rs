//! Every kiln integration test in one binary: each op's tests stay in their own file
//! (`tests/<op>.rs`), and this file only gathers them, because each test binary links Burn,
//! CubeCL, wgpu and cudarc and monomorphizes the shared parity harness again, which made linking
//! and codegen most of CI's build time. Run one op's tests with a filter:
//! `cargo test --features cuda --test suite nf4::`.

mod common;
mod dora;
mod flash_attention;
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
