//! A LoRA layer's base product and its rank-r update as one GEMM on Hopper's warpgroup MMA
//! (`linear.cu`, CUDA C++ after [`crate::hopper`]'s header and float wrappers and
//! [`OUT_ELEMENT`]): `out = x · W + l · Rᵀ (+ bias) (+ C)` with the update's `[m, r]` factor `l`
//! (already scaled) taken as one more reduction block, so the output is written once: the
//! forward's `x · W₀ + (s · h) · Bᵀ + b` and the input gradient's `dy · W₀ᵀ + dh · A + prior` (a
//! gradient of `x` registered before, as the residual C). Launched through CubeCL's CUDA runtime
//! ([`crate::cuda_source`]).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::{Binding, TensorMapBinding};

use crate::cuda_source::{CudaSourceKernel, FloatKind, OUT_ELEMENT, fingerprint, swizzled_tile_map};
use crate::hopper::{COMMON, WGMMA};

const SOURCE: &str = include_str!("linear.cu");
const FINGERPRINT: u64 = fingerprint(&[COMMON, WGMMA, OUT_ELEMENT, SOURCE]);

/// `linear.cu`'s tile (`FEATS` output columns by `TOKS` rows), reduction block and threads per
/// cube (a warpgroup copying, two running the MMAs).
const FEATS: usize = 128;
const TOKS: usize = 256;
const BK: usize = 64;
const THREADS: u32 = 384;
/// Rows of the output buffer: the tile is stored in two halves (`ROUNDS`).
const OUT_ROWS: usize = TOKS / 2;

/// `linear.cu`'s `KILN_SHARED_BYTES`: four stages of a `[256, 64]` block of x and a `[128, 64]`
/// block of W, a `[128, 128]` output buffer, two mbarriers a stage and the residual's, and 1 KB
/// to align the swizzled tiles.
const SHARED_BYTES: usize = 4 * (TOKS + FEATS) * BK * 2 + OUT_ROWS * FEATS * 2 + (2 * 4 + 1) * 8 + 1024;

/// The largest rank: the update is one reduction block of 64.
pub const MAX_RANK: usize = BK;

/// How a `[k, n]`-shaped operand (W, or the update's R `[r, n]`) is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Major {
    /// `[k, n]` row-major: n contiguous.
    N,
    /// `[n, k]` row-major (the transpose stored): k contiguous.
    K,
}

/// Whether the kernel takes `out[m, n] = x[m, k] · W + l[m, r] · Rᵀ` on a device of `sms` SMs:
/// f16 or bf16, rank `r` a multiple of 8 up to [`MAX_RANK`], and `k`, `n` multiples of 8 (16-byte
/// rows for the tensor maps), indices within 32 bits; where it measured faster than the base's
/// cuBLAS GEMM and a second product adding the update (H200, fifty-second session, rank 16,
/// `k = 4096`): at least three quarters of a wave of tiles (1024 rows against 4096 columns,
/// 128 tiles: 0.047 against 0.052 ms; 512 rows, 64 tiles: 0.044 against 0.030) and a reduction of
/// 2048 or more (777 × 1088 → 4104, 132 tiles: 0.023 against 0.020 ms). `KILN_LORA_LINEAR=0`
/// turns it off, for measuring the other path, and `=1` takes every shape it can run (the GPU
/// check's parity on small, ragged shapes). The caller checks the device (compute capability
/// 9.0: the source is `sm_90a`) and 16-byte aligned buffers.
pub fn serves(kind: FloatKind, [m, n, k, r]: [usize; 4], sms: usize) -> bool {
    let tiles = m.div_ceil(TOKS) * n.div_ceil(FEATS);
    let runs = kind != FloatKind::F32
        && m > 0
        && (1..=MAX_RANK).contains(&r)
        && r.is_multiple_of(8)
        && n.is_multiple_of(8)
        && k.is_multiple_of(8)
        && m.max(n).max(k) < i32::MAX as usize;
    let faster = k >= 2048 && 4 * tiles >= 3 * sms;
    match crate::measurement_override("KILN_LORA_LINEAR", 0..=1) {
        Some(0) => false,
        Some(_) => runs,
        None => runs && faster,
    }
}

/// The bindings of one product: `x` `[m, k]`, `w` and `r` stored as their [`Major`] says, `l`
/// `[m, r]`, the bias `[n]` and the residual `[m, n]` where there are any, and the output `[m,
/// n]`: dense, 16-byte aligned, one element kind.
pub struct LinearArgs {
    pub x: Binding,
    pub w: Binding,
    pub l: Binding,
    pub r: Binding,
    pub bias: Option<Binding>,
    pub residual: Option<Binding>,
    pub out: Binding,
}

fn source(params: &[u32]) -> String {
    let [kind, w_mn, r_mn, steps, residual] = params else { unreachable!("five lora linear parameters") };
    let wgmma = if *kind == FloatKind::F16 as u32 { "f16" } else { "bf16" };
    format!(
        "#define KILN_OUT_KIND {kind}\n#define KILN_WGMMA_TYPE \"{wgmma}\"\n#define KILN_W_MN {w_mn}\n#define KILN_R_MN {r_mn}\n#define KILN_UPDATE_STEPS {steps}\n#define KILN_RESIDUAL {residual}\n{COMMON}\n{WGMMA}\n{OUT_ELEMENT}\n{SOURCE}"
    )
}

/// The tensor map of an operand stored `[k, n]` or `[n, k]` for its `[rows, 64]` boxes: two
/// `[64, 64]` boxes a block when N-major, one `[128, 64]` when K-major.
fn operand_map(binding: Binding, kind: FloatKind, major: Major, [k, n]: [usize; 2]) -> TensorMapBinding {
    match major {
        Major::N => swizzled_tile_map(binding, kind, [k, n], [64, 64]),
        Major::K => swizzled_tile_map(binding, kind, [n, k], [FEATS, 64]),
    }
}

/// Enqueues `out = x · W + l · Rᵀ + bias + residual` for a shape the kernel [`serves`], W and R
/// stored as `w` and `r` say.
pub fn launch_linear(client: &ComputeClient<CudaRuntime>, kind: FloatKind, [m, n, k, r]: [usize; 4], [w_major, r_major]: [Major; 2], args: LinearArgs) {
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    assert!(serves(kind, [m, n, k, r], sms), "kiln lora linear: [{m}, {k}] · [{k}, {n}] + rank {r} of {kind:?}");
    let LinearArgs { x, w, l, r: right, bias, residual, out } = args;
    let params = vec![kind as u32, (w_major == Major::N) as u32, (r_major == Major::N) as u32, r.div_ceil(16) as u32, residual.is_some() as u32];
    let kernel = CudaSourceKernel { entry: "kiln_lora_linear", key: (FINGERPRINT, params), cube_dim: CubeDim::new_1d(THREADS), shared_bytes: SHARED_BYTES, source };
    // Without a residual, out's map and buffer stand in for C's (never read).
    let c = residual.unwrap_or_else(|| out.clone());
    let maps = vec![
        swizzled_tile_map(x, kind, [m, k], [TOKS, BK]),
        operand_map(w, kind, w_major, [k, n]),
        swizzled_tile_map(l.clone(), kind, [m, r], [TOKS, BK]),
        operand_map(right, kind, r_major, [r, n]),
        swizzled_tile_map(out, kind, [m, n], [OUT_ROWS, BK]),
        swizzled_tile_map(c, kind, [m, n], [OUT_ROWS, BK]),
    ];
    // `LinearParams`: rows, columns, the reduction, whether the bias is read (`l` stands in).
    let params = [m as u32, n as u32, k as u32, bias.is_some() as u32];
    let tiles = m.div_ceil(TOKS) * n.div_ceil(FEATS);
    let cubes = CubeCount::Static(tiles.min(sms) as u32, 1, 1);
    // CubeCL passes the maps' tensors right after the maps, before these buffers.
    kernel.launch_with_maps(client, cubes, maps, vec![bias.unwrap_or(l)], &params);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Half precision, ranks that are whole 16-byte rows up to one block, and shapes with a wave
    /// of tiles and a long enough reduction.
    #[test]
    fn serves_its_shapes_only() {
        let ok = |kind, shape| serves(kind, shape, 132);
        assert!(ok(FloatKind::Bf16, [4096, 4096, 4096, 16]));
        assert!(ok(FloatKind::F16, [1024, 4096, 4096, 64]));
        assert!(ok(FloatKind::Bf16, [4096, 4096, 11008, 8]));
        assert!(!ok(FloatKind::F32, [4096, 4096, 4096, 16]));
        assert!(!ok(FloatKind::Bf16, [4096, 4096, 4096, 12])); // rows of l not 16 bytes
        assert!(!ok(FloatKind::Bf16, [4096, 4096, 4096, 128])); // more than one block
        assert!(!ok(FloatKind::Bf16, [4096, 4100, 4096, 16]));
        assert!(!ok(FloatKind::Bf16, [512, 4096, 4096, 16])); // 64 tiles
        assert!(!ok(FloatKind::Bf16, [4096, 4096, 1088, 16])); // short reduction
        assert!(!ok(FloatKind::Bf16, [0, 4096, 4096, 16]));
    }

    /// The launch's shared memory fits Hopper's 227 KB a cube, and the source defines its
    /// parameters before the headers and names the entry point.
    #[test]
    fn source_fits_and_defines_its_parameters() {
        assert!(SHARED_BYTES <= 227 * 1024);
        let source = source(&[FloatKind::Bf16 as u32, 1, 0, 1, 1]);
        let at = |text: &str| source.find(text).unwrap_or_else(|| panic!("{text} is missing"));
        for define in ["KILN_OUT_KIND 2", "KILN_WGMMA_TYPE \"bf16\"", "KILN_W_MN 1", "KILN_R_MN 0", "KILN_UPDATE_STEPS 1", "KILN_RESIDUAL 1"] {
            assert!(at(define) < at("typedef unsigned int u32"), "{define}");
        }
        assert!(source.contains("kiln_lora_linear("));
    }
}
