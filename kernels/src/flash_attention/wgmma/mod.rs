//! The attention forward on Hopper's warpgroup MMA (`forward.cu`, CUDA C++), launched through
//! CubeCL's CUDA runtime ([`crate::cuda_source`]).
//!
//! It serves the common training/prefill case of the CubeCL forward (f16/bf16, head dim 64 or
//! 128, causal or not, GQA, any lengths, a positive scale, one split) at 1.5-1.9× the speed of
//! the `mma.sync` kernel and 1.2-1.4× FlashAttention-2's on the H100 (`benches/RESULTS.md`,
//! fifteenth session); softcap, window,
//! bias, decoding splits and other head dims stay on the CubeCL kernels. Its output and
//! log-sum-exp follow the same conventions, so the backward does not care which forward ran.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Binding;

use super::{AttentionShape, EMPTY_LSE};
use crate::cuda_source::{CudaSourceKernel, fingerprint};

const WRAPPERS: &str = include_str!("wgmma.cuh");
const FORWARD: &str = include_str!("forward.cu");
const SOURCE_FINGERPRINT: u64 = fingerprint(&[WRAPPERS, FORWARD]);

/// Compile-time parameters of one forward variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WgmmaForward {
    pub head_dim: usize,
    pub causal: bool,
    pub f16: bool,
}

/// Bytes `forward.cu` requests per cube (`KILN_SHARED_BYTES`): the Q tile, three K/V stages and
/// 1 KB to align the swizzled tiles.
const fn shared_bytes(head_dim: usize, block_k: usize, warpgroups: usize) -> usize {
    let row = head_dim * 2;
    64 * warpgroups * row + 3 * 2 * block_k * row + 1024
}

impl WgmmaForward {
    /// Keys per tile and warpgroups per cube, the fastest of those tried on the H100
    /// (hd128: 128 keys, 2 warpgroups, one cube per SM; hd64: 64 keys, 2 warpgroups, two cubes per SM).
    fn tiling(self) -> (usize, usize) {
        if self.head_dim == 64 { (64, 2) } else { (128, 2) }
    }

    /// Whether the kernel serves this problem (head dim; grid and stride limits).
    pub fn supports(shape: &AttentionShape) -> bool {
        matches!(shape.head_dim, 64 | 128) && shape.q_heads < 1 << 16 && shape.batch < 1 << 16 && shape.q_heads.is_multiple_of(shape.kv_heads)
    }

    fn kernel(self) -> CudaSourceKernel {
        let (block_k, warpgroups) = self.tiling();
        let params = [self.head_dim, block_k, warpgroups, self.causal as usize, self.f16 as usize].map(|p| p as u32);
        CudaSourceKernel {
            entry: "kiln_attention_forward",
            key: (SOURCE_FINGERPRINT, params.to_vec()),
            cube_dim: CubeDim::new_1d(128 * warpgroups as u32),
            shared_bytes: shared_bytes(self.head_dim, block_k, warpgroups),
            source,
        }
    }
}

/// The kernel's source for `params` = [head dim, keys per tile, warpgroups, causal, f16].
fn source(params: &[u32]) -> String {
    let [head_dim, block_k, warpgroups, causal, f16] = params else { unreachable!("five forward parameters") };
    let element = if *f16 == 1 { "f16" } else { "bf16" };
    format!(
        "#define KILN_D {head_dim}\n#define KILN_BC {block_k}\n#define KILN_WG {warpgroups}\n#define KILN_CAUSAL {causal}\n\
         #define KILN_F16 {f16}\n#define KILN_WGMMA_TYPE \"{element}\"\n#define KILN_EMPTY_LSE {EMPTY_LSE:?}f\n{WRAPPERS}\n{FORWARD}"
    )
}

/// Strides (in elements) of a `[batch, heads, len, d]` operand as the kernel takes them.
#[derive(Debug, Clone, Copy)]
pub struct RowStrides {
    pub batch: u32,
    pub head: u32,
    pub row: u32,
}

/// Operands of a launch: q, k, v (rows 16-byte aligned, unit last stride), out dense in q's
/// shape and dtype, lse dense f32 `[batch, q_heads, q_len]`.
pub struct WgmmaArgs {
    pub q: (Binding, RowStrides),
    pub k: (Binding, RowStrides),
    pub v: (Binding, RowStrides),
    pub out: Binding,
    pub lse: Binding,
}

/// Enqueues the forward on `client`'s stream.
pub fn launch_forward(client: &ComputeClient<CudaRuntime>, variant: WgmmaForward, shape: AttentionShape, scale: f32, args: WgmmaArgs) {
    let (_, warpgroups) = variant.tiling();
    let rows = 64 * warpgroups;
    let cubes = CubeCount::Static(shape.q_len.div_ceil(rows) as u32, shape.q_heads as u32, shape.batch as u32);
    let strides = |s: RowStrides| [s.batch, s.head, s.row];
    let mut scalars = vec![shape.q_heads as u32, (shape.q_heads / shape.kv_heads) as u32, shape.q_len as u32, shape.kv_len as u32];
    scalars.extend([args.q.1, args.k.1, args.v.1].into_iter().flat_map(strides));
    scalars.push((scale * std::f32::consts::LOG2_E).to_bits());
    let buffers = vec![args.q.0, args.k.0, args.v.0, args.out, args.lse];
    variant.kernel().launch(client, cubes, buffers, &scalars);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H100's opt-in shared memory per cube, and the share of one SM that leaves room for
    /// two cubes (228 KB per SM, 1 KB reserved per cube).
    const CUBE_LIMIT: usize = 227 * 1024;
    const HALF_SM: usize = 113 * 1024;

    #[test]
    fn tilings_fit_the_hopper_shared_memory_they_were_measured_with() {
        for head_dim in [64, 128] {
            let variant = WgmmaForward { head_dim, causal: false, f16: false };
            let (block_k, warpgroups) = variant.tiling();
            let bytes = shared_bytes(head_dim, block_k, warpgroups);
            assert!(bytes <= CUBE_LIMIT, "hd{head_dim}: {bytes} bytes");
            // hd64's tiling was chosen to run two cubes per SM.
            assert_eq!(head_dim == 64, bytes <= HALF_SM, "hd{head_dim}: {bytes} bytes");
            assert_eq!(variant.kernel().shared_bytes, bytes);
        }
    }

    #[test]
    fn source_defines_every_parameter_and_the_entry_point() {
        let text = source(&[128, 128, 2, 1, 1]);
        for define in ["KILN_D 128", "KILN_BC 128", "KILN_WG 2", "KILN_CAUSAL 1", "KILN_F16 1", "KILN_WGMMA_TYPE \"f16\"", "KILN_EMPTY_LSE 1e30f"] {
            assert!(text.contains(&format!("#define {define}\n")), "{define}");
        }
        assert!(text.contains("void wgmma_rs_n128") && text.contains("kiln_attention_forward("));
        // The shared memory the host requests is the amount the source lays out.
        assert!(FORWARD.contains("#define KILN_SHARED_BYTES (TILE_Q_BYTES + STAGES * 2 * TILE_KV_BYTES + 1024)"));
    }

    #[test]
    fn only_head_dims_64_and_128_with_whole_groups_are_served() {
        let shape = |head_dim, q_heads, kv_heads| AttentionShape { batch: 1, q_heads, kv_heads, q_len: 7, kv_len: 9, head_dim };
        assert!(WgmmaForward::supports(&shape(128, 8, 2)) && WgmmaForward::supports(&shape(64, 4, 4)));
        assert!(!WgmmaForward::supports(&shape(96, 8, 2)) && !WgmmaForward::supports(&shape(80, 8, 2)));
        assert!(!WgmmaForward::supports(&shape(128, 6, 4)));
    }
}
