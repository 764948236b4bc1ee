//! All-pairs trit scores on CUDA's binary tensor cores (`scores_mma.cu`): `mma.sync` on 1-bit
//! operands with AND + popcount, which CubeCL's IR has no instruction for, launched through
//! CubeCL's CUDA runtime ([`crate::cuda_source`]).
//!
//! Why: the portable kernel spends two popcounts per word pair and query, so 64 queries cost ten
//! times one; on the tensor cores the 256-trit products of 16 stored vectors and 8 queries are one
//! instruction each, and 64 queries read memory once at close to one query's time
//! (`benches/RESULTS.md`, twenty-seventh session). A first kernel prepares the queries in fragment
//! order (and their nonzero counts), so each cube stages them with contiguous asynchronous copies.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Binding;

use super::Metric;
use crate::cuda_source::{CudaSourceKernel, fingerprint};

const SOURCE: &str = include_str!("scores_mma.cu");
const FINGERPRINT: u64 = fingerprint(&[SOURCE]);
/// Warps per scores cube, vector tiles (of 16) per warp, slabs (of 256 trits) of stored words
/// loaded ahead. Measured on the H100 at 1M × 10 000 trits against 1, 8, 32 and 64 queries, among
/// 1–2 tiles, 4–16 warps and 1–4 slabs (twenty-seventh session).
const WARPS: usize = 8;
const VECTOR_TILES: usize = 1;
const DEPTH: usize = 4;
/// Query tiles (of 8) per cube: a launch takes more queries as more cubes along y.
const MAX_QUERY_TILES: usize = 8;
/// Staged entries (512 bytes per query tile and slab) per chunk buffer; two are in flight.
const CHUNK_ENTRIES: usize = 32;
/// Threads of the preparing kernel (one cube per query slot).
const PREPARE_THREADS: u32 = 128;
/// The fewest query rows the tensor-core path takes. On the H100 at 1M × 10 000 trits (twenty-
/// seventh session, through Burn) the portable kernel is faster up to 4 queries (1 query: 0.91
/// against 1.12 ms; 4: 0.91 against 1.14 ms), which it scores as one tile; from 5 it takes
/// 8-query tiles and loses (8, dot: 1.45 against 1.16 ms).
pub const MIN_QUERIES: usize = 5;
/// Word pairs per k-slab (256 trits).
const SLAB_PAIRS: usize = 8;

fn source(params: &[u32]) -> String {
    let [tiles, chunk, hamming] = params else { unreachable!("three trit mma parameters") };
    format!("#define KILN_NT {tiles}\n#define KILN_MT {VECTOR_TILES}\n#define KILN_WARPS {WARPS}\n#define KILN_KC {chunk}\n#define KILN_DEPTH {DEPTH}\n#define KILN_HAMMING {hamming}\n{SOURCE}")
}

/// The launch geometry for `query_rows`: query tiles per cube and slabs per staged chunk (a
/// multiple of [`DEPTH`], as the kernel's load ring needs).
fn geometry(query_rows: usize) -> (usize, usize) {
    let tiles = query_rows.div_ceil(8).clamp(1, MAX_QUERY_TILES);
    let chunk = (CHUNK_ENTRIES / tiles / DEPTH * DEPTH).max(DEPTH);
    (tiles, chunk)
}

/// u32 words of the prepared-queries buffer [`launch_scores_mma`] needs for `query_rows` queries of
/// `pairs` word pairs.
pub fn prepared_words(query_rows: usize, pairs: usize) -> usize {
    let (tiles, _) = geometry(query_rows);
    query_rows.div_ceil(8 * tiles) * pairs.div_ceil(SLAB_PAIRS) * tiles * 32 * 4
}

/// The bindings of an all-pairs score launch: queries `[query_rows, 2 · pairs]` and memory
/// `[memory_rows, 2 · pairs]` u32 words, the scores `[query_rows, memory_rows]` i32, and two
/// temporaries: `prepared` ([`prepared_words`] u32) and `nnz` (`query_rows` i32).
pub struct MmaScoreArgs {
    pub queries: Binding,
    pub memory: Binding,
    pub scores: Binding,
    pub prepared: Binding,
    pub nnz: Binding,
}

/// Whether [`launch_scores_mma`] takes these sizes: at least [`MIN_QUERIES`] query rows
/// (`KILN_TRIT_MMA_MIN_QUERIES` overrides it, to measure one path against the other), and counts
/// within the kernel's 32-bit indices and grid. The caller checks the device (compute capability
/// 8.0 and up).
pub fn takes(query_rows: usize, memory_rows: usize, pairs: usize) -> bool {
    let min = crate::measurement_override("KILN_TRIT_MMA_MIN_QUERIES", 1..=usize::MAX).unwrap_or(MIN_QUERIES);
    let groups = query_rows.div_ceil(8 * MAX_QUERY_TILES);
    query_rows >= min && memory_rows > 0 && pairs > 0 && memory_rows < u32::MAX as usize / 2 && pairs < u32::MAX as usize / 64 && groups <= u16::MAX as usize
}

/// Enqueues all-pairs scores on the tensor cores for sizes that [`takes`] accepts: the queries'
/// preparation, then the scores.
pub fn launch_scores_mma(client: &ComputeClient<CudaRuntime>, query_rows: usize, memory_rows: usize, pairs: usize, metric: Metric, args: MmaScoreArgs) {
    assert!(takes(query_rows, memory_rows, pairs), "kiln::trit scores (mma): {query_rows} queries against [{memory_rows}, {pairs}] word pairs");
    let (tiles, chunk) = geometry(query_rows);
    let groups = query_rows.div_ceil(8 * tiles);
    let key = (FINGERPRINT, vec![tiles as u32, chunk as u32, (metric == Metric::Hamming) as u32]);
    let scalars = [query_rows, memory_rows, pairs].map(|v| v as u32);

    let prepare = CudaSourceKernel { entry: "kiln_trit_prepare_queries", key: key.clone(), cube_dim: CubeDim::new_1d(PREPARE_THREADS), shared_bytes: 0, source };
    prepare.launch(client, CubeCount::Static((groups * 8 * tiles) as u32, 1, 1), vec![args.queries, args.prepared.clone(), args.nnz.clone()], &scalars);

    let shared_bytes = 2 * chunk * tiles * 32 * 16;
    let scores = CudaSourceKernel { entry: "kiln_trit_scores_mma", key, cube_dim: CubeDim::new_1d((WARPS * 32) as u32), shared_bytes, source };
    let cubes = CubeCount::Static(memory_rows.div_ceil(WARPS * VECTOR_TILES * 16) as u32, groups as u32, 1);
    scores.launch(client, cubes, vec![args.prepared, args.nnz, args.memory, args.scores], &scalars);
}
