//! LoRA's backward products that read the output gradient, `dh = s_dh · dy · B` and `dB = s_db ·
//! dyᵀ · h` (`s` and `s`, or `s` and 1 where `h` was scaled in the forward), in one pass over `dy` on CUDA's tensor cores (`dy.cu`), then one launch that adds the
//! cubes' f32 partial sums and rounds them. As two GEMMs each read all of `dy`; at rank 16 the
//! fused pair took 15.7 µs against torch's 26.4 for the two cuBLAS products at 4096 tokens,
//! 4096 → 4096 (H200, `benches/RESULTS.md`, forty-ninth session). Launched through CubeCL's CUDA
//! runtime ([`crate::cuda_source`]).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Binding;

use crate::cuda_source::{CudaSourceKernel, FloatKind, OUT_ELEMENT, fingerprint};
use crate::hopper::COMMON;

const SOURCE: &str = include_str!("dy.cu");
const FINGERPRINT: u64 = fingerprint(&[COMMON, OUT_ELEMENT, super::MMA, SOURCE]);
/// Tokens a cube (`KILN_TOKENS`), output features a step (`KILN_CHUNK`), threads a cube.
const TOKENS: usize = 256;
const CHUNK: usize = 64;
const THREADS: u32 = 256;
/// Slots of a cube's ring of `dy` chunks: three and two measured alike (probe, forty-ninth session).
const STAGES: usize = 3;
/// The largest rank the fused pair takes. Its products on `mma.sync` grow with the rank while the
/// GEMMs' time does not: at 4096 tokens, 4096 → 4096 (H200, forty-ninth session) it ran at 1.95× /
/// 1.68× torch's two cuBLAS products at ranks 8 / 16, 0.93× at 32 and 0.67× at 64. The kernel
/// itself takes any multiple of 8 up to 64 (`dy.cu`; parity at 24 and 32 in that session).
pub const MAX_RANK: usize = 16;

/// Whether the fused products may run: `KILN_LORA_FUSED=0` leaves them to two GEMMs (to measure
/// one against the other).
pub fn enabled() -> bool {
    crate::measurement_override("KILN_LORA_FUSED", 0..=1) != Some(0)
}

/// How one product pair is cut: cubes along the features (`splits`, each `per_split` chunks)
/// and along the tokens (`tiles`), and the cube's dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DyPlan {
    splits: usize,
    tiles: usize,
    per_split: usize,
    chunks: usize,
    shared: usize,
}

/// Dynamic shared bytes of a cube at rank `r`: the ring (each slot a chunk of `dy` in rows of 144
/// bytes and the chunk's rows of `B`), the cube's rows of `h`, and the dB hand-over scratch.
fn shared_bytes(r: usize) -> usize {
    STAGES * (TOKENS * (CHUNK + 8) * 2 + CHUNK * (r + 8) * 2) + TOKENS * (r + 8) * 2 + 2048 * (r / 8)
}

impl DyPlan {
    /// The plan for `tokens × out` at rank `r` on a device of `sms` SMs with `max_shared` bytes of
    /// shared memory a cube, if the kernel takes it: f16/bf16, `r` a multiple of 8 up to
    /// [`MAX_RANK`], `out` a multiple of 8 (16-byte rows), sizes within 32-bit indices and token
    /// tiles within the grid's second axis (65 535). About one cube an SM: a token tile's
    /// features are split until the grid fills the device.
    pub fn new(kind: FloatKind, tokens: usize, out: usize, r: usize, sms: usize, max_shared: usize) -> Option<Self> {
        let shared = shared_bytes(r);
        let fits = kind != FloatKind::F32
            && tokens > 0
            && out > 0
            && r > 0
            && r.is_multiple_of(8)
            && r <= MAX_RANK
            && out.is_multiple_of(8)
            && tokens.max(out) * r <= u32::MAX as usize
            && tokens.div_ceil(TOKENS) <= 65_535
            && shared <= max_shared;
        if !fits {
            return None;
        }
        let tiles = tokens.div_ceil(TOKENS);
        let chunks = out.div_ceil(CHUNK);
        let resident = (max_shared / (shared + 1024)).max(1);
        // Rounded down: one more split a tile would start a second wave on a few SMs.
        let wanted = (sms * resident / tiles).clamp(1, chunks);
        let per_split = chunks.div_ceil(wanted);
        // Every split gets at least one chunk (its slice of the `dh` partials is then written).
        let splits = chunks.div_ceil(per_split);
        Some(Self { splits, tiles, per_split, chunks, shared })
    }

    /// Elements of the f32 partial sums: `[splits, tokens, r]` for `dh`, `[tiles, out, r]` for `dB`.
    pub fn partials(&self, tokens: usize, out: usize, r: usize) -> (usize, usize) {
        (self.splits * tokens * r, self.tiles * out * r)
    }
}

/// The bindings of one pair: `dy` `[tokens, out]`, `B` `[out, r]`, `h` `[tokens, r]` (dense, 16-byte
/// aligned, one element kind), the partial sums (f32, sized by [`DyPlan::partials`]) and the
/// outputs `dh` `[tokens, r]` and `dB` `[out, r]` in the same kind.
pub struct DyArgs {
    pub dy: Binding,
    pub b: Binding,
    pub h: Binding,
    pub part_dh: Binding,
    pub part_db: Binding,
    pub dh: Binding,
    pub db: Binding,
}

fn source(params: &[u32]) -> String {
    let [kind, nj] = params else { unreachable!("two lora dy parameters") };
    format!("#define KILN_KIND {kind}\n#define KILN_OUT_KIND {kind}\n#define KILN_NJ {nj}\n#define KILN_STAGES {STAGES}\n{COMMON}\n{OUT_ELEMENT}\n{}\n{SOURCE}", super::MMA)
}

/// Enqueues both launches on `client`'s stream, the sums scaled by `dh`'s and `dB`'s scales. The caller made `plan` for these sizes and checked
/// a device of compute capability 8.0 or up.
#[allow(clippy::too_many_arguments)]
pub fn launch_dy_products(client: &ComputeClient<CudaRuntime>, kind: FloatKind, plan: DyPlan, tokens: usize, out: usize, r: usize, [scale_dh, scale_db]: [f32; 2], args: DyArgs) {
    let params = vec![kind as u32, (r / 8) as u32];
    let DyArgs { dy, b, h, part_dh, part_db, dh, db } = args;
    let products = CudaSourceKernel { entry: "kiln_lora_dy", key: (FINGERPRINT, params.clone()), cube_dim: CubeDim::new_1d(THREADS), shared_bytes: plan.shared, source };
    // `dy.cu`'s `Params`.
    let shape = [tokens, out, plan.chunks, plan.per_split].map(|v| v as u32);
    products.launch(client, CubeCount::Static(plan.splits as u32, plan.tiles as u32, 1), vec![dy, b, h, part_dh.clone(), part_db.clone()], &shape);
    let sum = CudaSourceKernel { entry: "kiln_lora_dy_sum", key: (FINGERPRINT, params), cube_dim: CubeDim::new_1d(256), shared_bytes: 0, source };
    let quads = (tokens + out) * r / 4;
    // `SumParams`: the scales as their bits.
    let sizes = [(tokens * r) as u32, (out * r) as u32, plan.splits as u32, plan.tiles as u32, scale_dh.to_bits(), scale_db.to_bits()];
    sum.launch(client, CubeCount::Static(quads.div_ceil(256) as u32, 1, 1), vec![part_dh, part_db, dh, db], &sizes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_fills_the_device_and_gives_every_split_a_chunk() {
        let plan = DyPlan::new(FloatKind::Bf16, 4096, 4096, 16, 132, 232_448).unwrap();
        assert_eq!((plan.tiles, plan.splits, plan.per_split), (16, 8, 8));
        // 172 chunks over 16 tiles: 8 splits (9 would start a second wave on 12 SMs).
        let plan = DyPlan::new(FloatKind::Bf16, 4096, 11008, 16, 132, 232_448).unwrap();
        assert_eq!((plan.tiles, plan.splits, plan.per_split), (16, 8, 22));
        let plan = DyPlan::new(FloatKind::Bf16, 1000, 4104, 8, 132, 232_448).unwrap();
        assert_eq!(plan.tiles, 4);
        assert!((plan.splits - 1) * plan.per_split < plan.chunks && plan.splits * plan.per_split >= plan.chunks);
        assert_eq!(plan.partials(1000, 4104, 8), (plan.splits * 8000, 4 * 4104 * 8));
    }

    #[test]
    fn plan_refuses_what_the_kernel_cannot_take() {
        let ok = |kind, tokens, out, r, shared| DyPlan::new(kind, tokens, out, r, 132, shared).is_some();
        assert!(ok(FloatKind::F16, 1, 8, 8, 232_448));
        assert!(!ok(FloatKind::F32, 4096, 4096, 16, 232_448));
        assert!(!ok(FloatKind::Bf16, 4096, 4100, 16, 232_448));
        assert!(!ok(FloatKind::Bf16, 4096, 4096, 12, 232_448));
        assert!(!ok(FloatKind::Bf16, 4096, 4096, 32, 232_448));
        assert!(!ok(FloatKind::Bf16, 4096, 4096, 16, 101_376));
        assert!(ok(FloatKind::Bf16, 65_535 * 256, 8, 8, 232_448) && !ok(FloatKind::Bf16, 65_535 * 256 + 1, 8, 8, 232_448));
    }
}
