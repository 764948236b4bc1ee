//! Attention forward and backward on Hopper's warpgroup MMA (`forward.cu`, `backward.cu`, CUDA
//! C++ after [`crate::hopper`]'s header and float wrappers and this folder's `common.cuh`), launched through CubeCL's CUDA runtime
//! ([`crate::cuda_source`]).
//!
//! They serve the common training/prefill case of the CubeCL kernels (f16/bf16, head dim 64 or
//! 128, causal or not, GQA, any lengths, a positive scale, one split): on the H100 the forward
//! runs at 1.5-1.9× the `mma.sync` kernel's speed and 1.2-1.4× FlashAttention-2's, the backward
//! at 1.03-1.15× FlashAttention-2's (`benches/RESULTS.md`, fifteenth and sixteenth sessions).
//! Softcap, window, bias, decoding splits and other head dims stay on the CubeCL kernels. Both
//! follow the CubeCL kernels' conventions (log-sum-exp, `EMPTY_LSE`, causal alignment), so
//! either forward pairs with either backward.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Binding;

use super::{AttentionShape, EMPTY_LSE};
use crate::cuda_source::{CudaSourceKernel, fingerprint};
use crate::hopper::{COMMON as HOPPER, WGMMA as WRAPPERS};

const COMMON: &str = include_str!("common.cuh");
const FORWARD: &str = include_str!("forward.cu");
const BACKWARD: &str = include_str!("backward.cu");
const FORWARD_FINGERPRINT: u64 = fingerprint(&[HOPPER, WRAPPERS, COMMON, FORWARD]);
const BACKWARD_FINGERPRINT: u64 = fingerprint(&[HOPPER, WRAPPERS, COMMON, BACKWARD]);

/// Compile-time parameters of one kernel variant (forward or backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WgmmaVariant {
    pub head_dim: usize,
    pub causal: bool,
    pub f16: bool,
}

/// Bytes `forward.cu` requests per cube (`KILN_SHARED_BYTES`): the Q tile, three K/V stages and
/// 1 KB to align the swizzled tiles.
const fn forward_shared_bytes(head_dim: usize, block_k: usize, warpgroups: usize) -> usize {
    let row = head_dim * 2;
    64 * warpgroups * row + 3 * 2 * block_k * row + 1024
}

/// Keys per cube and queries per step of `backward.cu` (`BC`, `BR`).
const BACKWARD_KEYS: usize = 128;
const BACKWARD_QUERIES: usize = 64;

/// Bytes `backward.cu` requests per cube: K and V, two stages of (Q, dO), dSᵀ, two stages of
/// the steps' lse and D, and 1 KB for alignment.
const fn backward_shared_bytes(head_dim: usize) -> usize {
    let row = head_dim * 2;
    2 * BACKWARD_KEYS * row + 4 * BACKWARD_QUERIES * row + BACKWARD_KEYS * BACKWARD_QUERIES * 2 + 2 * 2 * BACKWARD_QUERIES * 4 + 1024
}

impl WgmmaVariant {
    /// Whether the kernels serve this problem (head dim; grid and stride limits).
    pub fn supports(shape: &AttentionShape) -> bool {
        matches!(shape.head_dim, 64 | 128) && shape.q_heads < 1 << 16 && shape.batch < 1 << 16 && shape.q_heads.is_multiple_of(shape.kv_heads)
    }

    /// The forward's keys per tile and warpgroups per cube, the fastest of those tried on the
    /// H100 (hd128: 128 keys, 2 warpgroups, one cube per SM; hd64: 64 keys, 2 warpgroups, two
    /// cubes per SM).
    fn forward_tiling(self) -> (usize, usize) {
        if self.head_dim == 64 { (64, 2) } else { (128, 2) }
    }

    fn forward_kernel(self) -> CudaSourceKernel {
        let (block_k, warpgroups) = self.forward_tiling();
        let params = [self.head_dim, self.causal as usize, self.f16 as usize, block_k, warpgroups].map(|p| p as u32);
        CudaSourceKernel {
            entry: "kiln_attention_forward",
            key: (FORWARD_FINGERPRINT, params.to_vec()),
            cube_dim: CubeDim::new_1d(128 * warpgroups as u32),
            shared_bytes: forward_shared_bytes(self.head_dim, block_k, warpgroups),
            source: forward_source,
        }
    }

    fn backward_kernel(self) -> CudaSourceKernel {
        let params = [self.head_dim, self.causal as usize, self.f16 as usize].map(|p| p as u32);
        CudaSourceKernel {
            entry: "kiln_attention_backward",
            key: (BACKWARD_FINGERPRINT, params.to_vec()),
            cube_dim: CubeDim::new_1d(256),
            shared_bytes: backward_shared_bytes(self.head_dim),
            source: backward_source,
        }
    }
}

/// The defines both kernels take, from `params` = [head dim, causal, f16, ..].
fn element_defines(params: &[u32]) -> String {
    let [head_dim, causal, f16, ..] = params else { unreachable!("head dim, causal and f16 lead every variant's parameters") };
    let element = if *f16 == 1 { "f16" } else { "bf16" };
    format!("#define KILN_D {head_dim}\n#define KILN_CAUSAL {causal}\n#define KILN_F16 {f16}\n#define KILN_WGMMA_TYPE \"{element}\"\n")
}

/// The forward's source for `params` = [head dim, causal, f16, keys per tile, warpgroups].
fn forward_source(params: &[u32]) -> String {
    let [.., block_k, warpgroups] = params else { unreachable!("five forward parameters") };
    let defines = element_defines(params);
    format!("{defines}#define KILN_BC {block_k}\n#define KILN_WG {warpgroups}\n#define KILN_EMPTY_LSE {EMPTY_LSE:?}f\n{HOPPER}\n{WRAPPERS}\n{COMMON}\n{FORWARD}")
}

/// The backward's source for `params` = [head dim, causal, f16].
fn backward_source(params: &[u32]) -> String {
    format!("{}{HOPPER}\n{WRAPPERS}\n{COMMON}\n{BACKWARD}", element_defines(params))
}

/// Strides (in elements) of a `[batch, heads, len, d]` operand as the kernels take them.
#[derive(Debug, Clone, Copy)]
pub struct RowStrides {
    pub batch: u32,
    pub head: u32,
    pub row: u32,
}

impl RowStrides {
    fn words(self) -> [u32; 3] {
        [self.batch, self.head, self.row]
    }
}

/// The scalars both kernels start with: head counts and lengths.
fn problem_words(shape: AttentionShape) -> Vec<u32> {
    [shape.q_heads, shape.q_heads / shape.kv_heads, shape.q_len, shape.kv_len].map(|n| n as u32).to_vec()
}

/// Operands of a forward: q, k, v (rows 16-byte aligned, unit last stride), out in q's shape and
/// dtype (unit last stride, any other strides), lse dense f32 `[batch, q_heads, q_len]`.
pub struct ForwardArgs {
    pub q: (Binding, RowStrides),
    pub k: (Binding, RowStrides),
    pub v: (Binding, RowStrides),
    pub out: (Binding, RowStrides),
    pub lse: Binding,
}

/// Enqueues the forward on `client`'s stream.
pub fn launch_forward(client: &ComputeClient<CudaRuntime>, variant: WgmmaVariant, shape: AttentionShape, scale: f32, args: ForwardArgs) {
    let (_, warpgroups) = variant.forward_tiling();
    let rows = 64 * warpgroups;
    let cubes = CubeCount::Static(shape.q_len.div_ceil(rows) as u32, shape.q_heads as u32, shape.batch as u32);
    let mut scalars = problem_words(shape);
    scalars.extend([args.q.1, args.k.1, args.v.1, args.out.1].into_iter().flat_map(RowStrides::words));
    scalars.push((scale * std::f32::consts::LOG2_E).to_bits());
    let buffers = vec![args.q.0, args.k.0, args.v.0, args.out.0, args.lse];
    variant.forward_kernel().launch(client, cubes, buffers, &scalars);
}

/// Operands of a backward: q, k, v, d_out (rows 16-byte aligned, unit last stride); lse (the
/// forward's) and delta (`Σ dO·O` per row) dense f32 `[batch, q_heads, q_len]`; dq dense f32 in
/// q's shape, zeroed (the kernel adds into it); dk, dv in k's shape and dtype, both at the strides
/// `kv_grads` (unit last stride).
pub struct BackwardArgs {
    pub q: (Binding, RowStrides),
    pub k: (Binding, RowStrides),
    pub v: (Binding, RowStrides),
    pub d_out: (Binding, RowStrides),
    pub lse: Binding,
    pub delta: Binding,
    pub dq: Binding,
    pub dk: Binding,
    pub dv: Binding,
    pub kv_grads: RowStrides,
}

/// Enqueues the backward on `client`'s stream.
pub fn launch_backward(client: &ComputeClient<CudaRuntime>, variant: WgmmaVariant, shape: AttentionShape, scale: f32, args: BackwardArgs) {
    let cubes = CubeCount::Static(shape.kv_len.div_ceil(BACKWARD_KEYS) as u32, shape.kv_heads as u32, shape.batch as u32);
    let mut scalars = problem_words(shape);
    scalars.extend([args.q.1, args.k.1, args.v.1, args.d_out.1, args.kv_grads].into_iter().flat_map(RowStrides::words));
    scalars.extend([scale, scale * std::f32::consts::LOG2_E].map(f32::to_bits));
    let buffers = vec![args.q.0, args.k.0, args.v.0, args.d_out.0, args.lse, args.delta, args.dq, args.dk, args.dv];
    variant.backward_kernel().launch(client, cubes, buffers, &scalars);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H100's opt-in shared memory per cube, and the share of one SM that leaves room for
    /// two cubes (228 KB per SM, 1 KB reserved per cube).
    const CUBE_LIMIT: usize = 227 * 1024;
    const HALF_SM: usize = 113 * 1024;

    fn variant(head_dim: usize) -> WgmmaVariant {
        WgmmaVariant { head_dim, causal: false, f16: false }
    }

    #[test]
    fn tilings_fit_the_hopper_shared_memory_they_were_measured_with() {
        for head_dim in [64, 128] {
            let (block_k, warpgroups) = variant(head_dim).forward_tiling();
            let bytes = forward_shared_bytes(head_dim, block_k, warpgroups);
            assert!(bytes <= CUBE_LIMIT, "hd{head_dim}: {bytes} bytes");
            // hd64's forward tiling was chosen to run two cubes per SM.
            assert_eq!(head_dim == 64, bytes <= HALF_SM, "hd{head_dim}: {bytes} bytes");
            assert_eq!(variant(head_dim).forward_kernel().shared_bytes, bytes);
            let bytes = backward_shared_bytes(head_dim);
            assert!(bytes <= CUBE_LIMIT, "hd{head_dim} backward: {bytes} bytes");
            assert_eq!(variant(head_dim).backward_kernel().shared_bytes, bytes);
        }
    }

    #[test]
    fn sources_define_every_parameter_and_the_entry_points() {
        let text = forward_source(&[128, 1, 1, 128, 2]);
        for define in ["KILN_D 128", "KILN_BC 128", "KILN_WG 2", "KILN_CAUSAL 1", "KILN_F16 1", "KILN_WGMMA_TYPE \"f16\"", "KILN_EMPTY_LSE 1e30f"] {
            assert!(text.contains(&format!("#define {define}\n")), "{define}");
        }
        assert!(text.contains("void wgmma_rs_n128") && text.contains("void stage(") && text.contains("kiln_attention_forward("));
        let text = backward_source(&[64, 0, 0]);
        for define in ["KILN_D 64", "KILN_CAUSAL 0", "KILN_F16 0", "KILN_WGMMA_TYPE \"bf16\""] {
            assert!(text.contains(&format!("#define {define}\n")), "{define}");
        }
        assert!(text.contains("void wgmma_ss_mn_n32") && text.contains("kiln_attention_backward("));
        // The shared memory the host requests is the amount the sources lay out.
        assert!(FORWARD.contains("#define KILN_SHARED_BYTES (TILE_Q_BYTES + STAGES * 2 * TILE_KV_BYTES + 1024)"));
        assert!(BACKWARD.contains("#define KILN_SHARED_BYTES (2 * TILE_KV_BYTES + 4 * TILE_Q_BYTES + TILE_DS_BYTES + 2 * STATS_BYTES + 1024)"));
        assert!(BACKWARD.contains(&format!("#define BC {BACKWARD_KEYS} ")) && BACKWARD.contains(&format!("#define BR {BACKWARD_QUERIES} ")));
    }

    #[test]
    fn only_head_dims_64_and_128_with_whole_groups_are_served() {
        let shape = |head_dim, q_heads, kv_heads| AttentionShape { batch: 1, q_heads, kv_heads, q_len: 7, kv_len: 9, head_dim };
        assert!(WgmmaVariant::supports(&shape(128, 8, 2)) && WgmmaVariant::supports(&shape(64, 4, 4)));
        assert!(!WgmmaVariant::supports(&shape(96, 8, 2)) && !WgmmaVariant::supports(&shape(80, 8, 2)));
        assert!(!WgmmaVariant::supports(&shape(128, 6, 4)));
    }
}
