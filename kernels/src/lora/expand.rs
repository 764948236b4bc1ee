//! LoRA's input gradient `dx = dropout(dh · A) + prior` in one pass on CUDA (`expand.cu`): the
//! rank-r `dh` expanded to the full width, dropped out and added to the gradient registered
//! before, writing `dx` once instead of a GEMM, a dropout kernel and an add. At 4096 tokens, rank
//! 16, 4096 features (H200, fiftieth session): 23–24 µs with the dropout and the prior against 68
//! for torch's product, mask and add; LoRA steps with dropout 0.1 −11 to −17 µs. Without a
//! dropout (13.4–14.2 µs alone, 22.7 with the prior) it gained nothing measurable over cuBLASLt's
//! one product in whole steps, so kiln takes it for dropped-out `dx` only. Launched through
//! CubeCL's CUDA runtime ([`crate::cuda_source`]).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Binding;

use super::DropoutMask;
use crate::cuda_source::{CudaSourceKernel, FloatKind, OUT_ELEMENT, fingerprint};
use crate::hopper::COMMON;

const SOURCE: &str = include_str!("expand.cu");
const FINGERPRINT: u64 = fingerprint(&[COMMON, OUT_ELEMENT, super::MMA, SOURCE]);
/// Warps a cube (`KILN_WARPS`) and output columns a warp.
const WARPS: usize = 4;
const WARP_COLUMNS: usize = 64;
/// Cubes an SM the grid is sized for: 4 and 8 measured alike, 16 slower for `dx` (probe,
/// fiftieth session).
const CUBES_PER_SM: usize = 8;
/// The largest rank taken: at rank 64 (four MMA steps a tile) `dx` took 25–30 µs against
/// cuBLASLt's ~14 at 4096² (probe, fiftieth session); ranks 8 and 16 are one step.
pub const MAX_RANK: usize = 16;

/// Whether the kernel may run: `KILN_LORA_EXPAND=0` leaves these products to the GEMM (and the
/// dropout and add kernels), to measure one against the other.
pub fn enabled() -> bool {
    crate::measurement_override("KILN_LORA_EXPAND", 0..=1) != Some(0)
}

/// One expanding product's grid: column groups of a cube, and cubes along the 16-row tiles
/// (sized to the device's resident cubes; a cube strides over the tiles).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpandPlan {
    columns: usize,
    rows: usize,
}

impl ExpandPlan {
    /// The plan for a `[tokens, n]` output at rank `r` on a device of `sms` SMs, if the kernel
    /// takes it: f16/bf16, `r` a multiple of 8 up to [`MAX_RANK`], `n` a multiple of 8 (16-byte
    /// rows), the output's elements within 32 bits (the dropout's index).
    pub fn new(kind: FloatKind, tokens: usize, n: usize, r: usize, sms: usize) -> Option<Self> {
        let fits = kind != FloatKind::F32 && tokens > 0 && n > 0 && r > 0 && r.is_multiple_of(8) && r <= MAX_RANK && n.is_multiple_of(8) && tokens * n <= u32::MAX as usize;
        if !fits {
            return None;
        }
        let columns = n.div_ceil(WARPS * WARP_COLUMNS);
        let rows = tokens.div_ceil(16).min((sms * CUBES_PER_SM).div_ceil(columns)).min(65_535);
        Some(Self { columns, rows })
    }
}

/// The bindings of one product: `L` `[tokens, r]`, `R` `[r, n]`, the residual `C` `[tokens, n]`
/// where there is one, and the output `[tokens, n]`: dense, 16-byte aligned, one element kind.
pub struct ExpandArgs {
    pub l: Binding,
    pub right: Binding,
    pub residual: Option<Binding>,
    pub out: Binding,
}

fn source(params: &[u32]) -> String {
    let [kind, r, dropout, residual] = params else { unreachable!("four lora expand parameters") };
    format!(
        "#define KILN_KIND {kind}\n#define KILN_OUT_KIND {kind}\n#define KILN_R {r}\n#define KILN_DROPOUT {dropout}\n#define KILN_RESIDUAL {residual}\n{COMMON}\n{OUT_ELEMENT}\n{}\n{SOURCE}",
        super::MMA
    )
}

/// Enqueues `out = dropout(scale · L · R) + C` on `client`'s stream (`dropout` over the output's
/// row-major indices). The caller made `plan` for these sizes and checked a device of compute
/// capability 8.0 or up.
#[allow(clippy::too_many_arguments)]
pub fn launch_expand(client: &ComputeClient<CudaRuntime>, kind: FloatKind, plan: ExpandPlan, [tokens, n, r]: [usize; 3], scale: f32, dropout: Option<DropoutMask>, args: ExpandArgs) {
    let ExpandArgs { l, right, residual, out } = args;
    let params = vec![kind as u32, r as u32, dropout.is_some() as u32, residual.is_some() as u32];
    let kernel = CudaSourceKernel { entry: "kiln_lora_expand", key: (FINGERPRINT, params), cube_dim: CubeDim::new_1d((WARPS * 32) as u32), shared_bytes: 0, source };
    let mask = dropout.unwrap_or(DropoutMask { key: 0, threshold: 0, scale: 1.0 });
    // `expand.cu`'s `ExpandParams`; without a residual `L` stands in for `C` (never read).
    let scalars = [tokens as u32, n as u32, scale.to_bits(), mask.key, mask.threshold, mask.scale.to_bits()];
    let c = residual.unwrap_or_else(|| l.clone());
    kernel.launch(client, CubeCount::Static(plan.columns as u32, plan.rows as u32, 1), vec![l, right, c, out], &scalars);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_sizes_the_grid_to_the_device() {
        let plan = ExpandPlan::new(FloatKind::Bf16, 4096, 4096, 16, 132).unwrap();
        // 16 column groups of 256; 1056 resident cubes over them: 66 along the 256 row tiles.
        assert_eq!((plan.columns, plan.rows), (16, 66));
        // Few rows: one cube a tile.
        let plan = ExpandPlan::new(FloatKind::F16, 20, 1000, 8, 132).unwrap();
        assert_eq!((plan.columns, plan.rows), (4, 2));
    }

    #[test]
    fn plan_refuses_what_the_kernel_cannot_take() {
        let ok = |kind, tokens, n, r| ExpandPlan::new(kind, tokens, n, r, 132).is_some();
        assert!(ok(FloatKind::Bf16, 1, 8, 8));
        assert!(!ok(FloatKind::F32, 4096, 4096, 16));
        assert!(!ok(FloatKind::Bf16, 4096, 4100, 16));
        assert!(!ok(FloatKind::Bf16, 4096, 4096, 12));
        assert!(!ok(FloatKind::Bf16, 4096, 4096, 32));
        assert!(!ok(FloatKind::Bf16, 1 << 20, 1 << 12, 16));
    }
}
