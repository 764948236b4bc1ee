//! Similarity of packed trit vectors: scores of query rows against stored rows (all pairs, or
//! row by row), and an exact top-k over score rows with ties broken by the lower index.

use cubecl::prelude::*;

/// Units of a score or top-k cube.
const CUBE_UNITS: usize = 256;
/// Query vectors per row staged in shared memory at a time by the all-pairs scores.
const STAGE: usize = 64;
/// Memory vectors a unit loads per staged chunk before scoring them: `STAGE` over the largest
/// group (8 units a row). One load in flight per unit held the 1-query dot scores at 69% of the
/// H100's HBM with 8-byte vectors (`benches/RESULTS.md`, twenty-seventh session).
const LOADS_AHEAD: usize = STAGE / 8;
/// Score rows each top-k cube selects from: `CUBE_UNITS` units × 8.
pub const TOPK_CHUNK: usize = CUBE_UNITS * TOPK_PER_UNIT;
const TOPK_PER_UNIT: usize = 8;
/// The largest k of the top-k kernel (a pass then shrinks its input at least eightfold).
pub const TOPK_MAX_K: usize = TOPK_CHUNK / 8;

/// What a score counts between two vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Metric {
    /// `Σ aᵢ · bᵢ`: higher is more similar.
    Dot,
    /// Positions where the trits differ: lower is more similar.
    Hamming,
}

/// Where a vector's trits sit in its words: kiln's layout, or the 2-bit codes it was chosen over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WordLayout {
    /// Two bit-planes per 32 trits (`kiln::ops::trit::format`).
    Planes,
    /// 16 trits a word, trit `i` at bits `2i` (+1) and `2i + 1` (−1): same bytes, planes split by
    /// masks and shifts. Kept so that the GPU check can time both (`trit-layout`).
    Codes,
}

/// The score of 32 trits given as a plus and a minus plane each.
#[cube]
fn planes_score(ap: u32, am: u32, bp: u32, bm: u32, #[comptime] hamming: bool) -> i32 {
    if comptime!(hamming) {
        i32::cast_from(((ap ^ bp) | (am ^ bm)).count_ones())
    } else {
        i32::cast_from(((ap & bp) | (am & bm)).count_ones()) - i32::cast_from(((ap & bm) | (am & bp)).count_ones())
    }
}

/// The score of one vector of words against another (`pairs_per_vector` = words / 2).
#[cube]
fn vector_score<N: Size>(a: Vector<u32, N>, b: Vector<u32, N>, #[comptime] pairs_per_vector: usize, #[comptime] hamming: bool, #[comptime] codes: bool) -> i32 {
    let mut s = 0i32;
    if comptime!(codes) {
        let even = 0x5555_5555u32;
        #[unroll]
        for i in 0..comptime!(2 * pairs_per_vector) {
            s += planes_score(a[i] & even, (a[i] >> 1u32) & even, b[i] & even, (b[i] >> 1u32) & even, hamming);
        }
    } else {
        #[unroll]
        for p in 0..pairs_per_vector {
            s += planes_score(a[2 * p], a[2 * p + 1], b[2 * p], b[2 * p + 1], hamming);
        }
    }
    s
}

/// Groups of `group` units per stored row, each unit striding over the row's vectors of words
/// and scoring them against `tile` query rows at a time (the row's words stay in cache across
/// tiles; the tile's query words are staged in shared memory for the whole cube); the group's
/// partial scores are summed through shared memory. All pairs: `scores[q][row]`
/// for every query row; pairwise: `scores[row]` against query row `row` (or 0 with one query).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn scores_kernel<N: Size>(
    queries: &Array<Vector<u32, N>>,
    memory: &Array<Vector<u32, N>>,
    scores: &mut Array<i32>,
    query_rows: usize,
    memory_rows: usize,
    vectors: usize,
    #[comptime] pairs_per_vector: usize,
    #[comptime] group: usize,
    #[comptime] tile: usize,
    #[comptime] hamming: bool,
    #[comptime] pairwise: bool,
    #[comptime] codes: bool,
) {
    let mut partial = SharedMemory::<i32>::new(comptime!(CUBE_UNITS * tile));
    let mut staged = SharedMemory::<Vector<u32, N>>::new(comptime!(tile * STAGE));
    let unit = UNIT_POS as usize;
    let lane = unit % group;
    let row = CUBE_POS * comptime!(CUBE_UNITS / group) + unit / group;
    let valid = row < memory_rows;
    let mut passes = query_rows.div_ceil(tile);
    if comptime!(pairwise) {
        passes = 1;
    }
    for pass in 0..passes {
        let mut acc = Array::<i32>::new(tile);
        #[unroll]
        for t in 0..tile {
            acc[t] = 0;
        }
        if comptime!(pairwise) {
            if valid {
                let mut v = lane;
                while v < vectors {
                    let m = memory[row * vectors + v];
                    // Query row `row`, or 0 when one query row serves every memory row.
                    let q = select(query_rows == 1, 0, row) * vectors;
                    acc[0] += vector_score::<N>(m, queries[q + v], pairs_per_vector, hamming, codes);
                    v += group;
                }
            }
        } else {
            // The tile's query vectors pass through shared memory a chunk of STAGE at a time: every
            // group of the cube reads them there instead of each from the cache.
            for chunk in 0..vectors.div_ceil(STAGE) {
                let first = chunk * STAGE;
                let mut i = unit;
                while i < comptime!(tile * STAGE) {
                    let q = (pass * tile + i / STAGE).min(query_rows - 1);
                    staged[i] = queries[q * vectors + (first + i % STAGE).min(vectors - 1)];
                    i += CUBE_UNITS;
                }
                sync_cube();
                if valid {
                    // The unit's vectors of the chunk (lane, lane + group, …: at most
                    // `STAGE / 8` when `group` is 8, one when a row holds fewer than 8) are all
                    // loaded before any is scored, so their loads are in flight together; a
                    // slot past the chunk reads its last vector and is not scored.
                    let end = (vectors - first).min(STAGE);
                    let mut words = Array::<Vector<u32, N>>::new(LOADS_AHEAD);
                    #[unroll]
                    for i in 0..LOADS_AHEAD {
                        words[i] = memory[row * vectors + first + (lane + i * group).min(end - 1)];
                    }
                    #[unroll]
                    for i in 0..LOADS_AHEAD {
                        let c = lane + i * group;
                        if c < end {
                            #[unroll]
                            for t in 0..tile {
                                acc[t] += vector_score::<N>(words[i], staged[t * STAGE + c], pairs_per_vector, hamming, codes);
                            }
                        }
                    }
                }
                sync_cube();
            }
        }
        #[unroll]
        for t in 0..tile {
            partial[unit * tile + t] = acc[t];
        }
        sync_cube();
        #[unroll]
        for step in 0..comptime!(group.trailing_zeros() as usize) {
            let stride = comptime!(group >> (step + 1));
            if lane < stride {
                #[unroll]
                for t in 0..tile {
                    partial[unit * tile + t] += partial[(unit + stride) * tile + t];
                }
            }
            sync_cube();
        }
        if valid && lane == 0 {
            #[unroll]
            for t in 0..tile {
                let q = pass * tile + t;
                if comptime!(pairwise) {
                    scores[row] = partial[unit * tile];
                } else if q < query_rows {
                    scores[q * memory_rows + row] = partial[unit * tile + t];
                }
            }
        }
        sync_cube();
    }
}

/// Whether `(key, index)` ranks before `(best_key, best_index)`.
#[cube]
fn ranks_before(key: i32, index: i32, best_key: i32, best_index: i32, #[comptime] smallest: bool) -> bool {
    let wins = if comptime!(smallest) { key < best_key } else { key > best_key };
    wins || (key == best_key && index < best_index)
}

/// One cube per `(chunk, row)`: the chunk's `k` best `(key, index)` entries in rank order, by
/// `k` rounds of a shared-memory arg-best over the chunk. Missing entries (a short chunk) come
/// out as `(worst key, i32::MAX)`, which rank after every real one.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn topk_kernel(
    keys: &Array<i32>,
    indices: &Array<i32>,
    out_keys: &mut Array<i32>,
    out_indices: &mut Array<i32>,
    n: usize,
    chunks: usize,
    k: usize,
    #[comptime] explicit: bool,
    #[comptime] smallest: bool,
) {
    let mut chunk_keys = SharedMemory::<i32>::new(TOPK_CHUNK);
    let mut chunk_indices = SharedMemory::<i32>::new(TOPK_CHUNK);
    let mut best_keys = SharedMemory::<i32>::new(CUBE_UNITS);
    let mut best_indices = SharedMemory::<i32>::new(CUBE_UNITS);
    let mut best_slots = SharedMemory::<u32>::new(CUBE_UNITS);
    let (chunk, row, unit) = (CUBE_POS_X as usize, CUBE_POS_Y as usize, UNIT_POS as usize);
    let worst = if comptime!(smallest) { i32::MAX.runtime() } else { i32::MIN.runtime() };
    #[unroll]
    for e in 0..TOPK_PER_UNIT {
        let slot = e * CUBE_UNITS + unit;
        let pos = chunk * TOPK_CHUNK + slot;
        let live = pos < n;
        let at = select(live, row * n + pos, 0);
        let mut index = pos as i32;
        if comptime!(explicit) {
            index = indices[at];
        }
        chunk_keys[slot] = select(live, keys[at], worst);
        chunk_indices[slot] = select(live, index, i32::MAX.runtime());
    }
    sync_cube();
    for round in 0..k {
        let mut key = worst;
        let mut index = i32::MAX.runtime();
        let mut from = unit as u32;
        #[unroll]
        for e in 0..TOPK_PER_UNIT {
            let slot = e * CUBE_UNITS + unit;
            let (k2, i2) = (chunk_keys[slot], chunk_indices[slot]);
            if ranks_before(k2, i2, key, index, smallest) {
                key = k2;
                index = i2;
                from = slot as u32;
            }
        }
        best_keys[unit] = key;
        best_indices[unit] = index;
        best_slots[unit] = from;
        sync_cube();
        #[unroll]
        for step in 0..comptime!(CUBE_UNITS.trailing_zeros() as usize) {
            let stride = comptime!(CUBE_UNITS >> (step + 1));
            // Nested, not `&&`: CubeCL evaluates both operands, and the right one reads past
            // the reduction's live half.
            #[allow(clippy::collapsible_if)]
            if unit < stride {
                if ranks_before(best_keys[unit + stride], best_indices[unit + stride], best_keys[unit], best_indices[unit], smallest) {
                    best_keys[unit] = best_keys[unit + stride];
                    best_indices[unit] = best_indices[unit + stride];
                    best_slots[unit] = best_slots[unit + stride];
                }
            }
            sync_cube();
        }
        if unit == 0 {
            let out = (row * chunks + chunk) * k + round;
            out_keys[out] = best_keys[0];
            out_indices[out] = best_indices[0];
            let taken = best_slots[0] as usize;
            chunk_keys[taken] = worst;
            chunk_indices[taken] = i32::MAX.runtime();
        }
        sync_cube();
    }
}

/// Arguments of a score launch: rows of `vectors` vectors of `vector_size` words (even).
pub struct ScoreArgs<R: Runtime> {
    pub queries: ArrayArg<R>,
    pub memory: ArrayArg<R>,
    /// `query_rows × memory_rows` i32 (all pairs) or `memory_rows` (pairwise).
    pub scores: ArrayArg<R>,
    pub query_rows: usize,
    pub memory_rows: usize,
    pub vectors: usize,
    pub vector_size: usize,
    pub metric: Metric,
    /// Row `i` of the memory against query row `i` (or the single query row).
    pub pairwise: bool,
    pub layout: WordLayout,
}

/// Launch the scores of [`ScoreArgs`].
pub fn launch_scores<R: Runtime>(client: &ComputeClient<R>, args: ScoreArgs<R>) {
    if args.memory_rows == 0 || args.query_rows == 0 {
        return;
    }
    // Enough units per row to issue 16-byte loads of a 10k-trit row in a few steps; a tile of
    // queries sized to the batch (a pass re-reads the row from cache, not from memory). Two
    // queries take a tile of four: on the H100 a tile of two scored 1M × 10 000 trits in 1.34 ms
    // against four queries' 0.91 (`benches/RESULTS.md`, twenty-seventh session).
    let group = (args.vectors.next_power_of_two()).clamp(1, 8);
    let tile = match args.query_rows {
        _ if args.pairwise => 1,
        2 => 4,
        q => q.next_power_of_two().min(16),
    };
    let units = args.memory_rows.div_ceil(CUBE_UNITS / group) * CUBE_UNITS;
    let dim = CubeDim::new_1d(CUBE_UNITS as u32);
    let count = cubecl::calculate_cube_count_elemwise(client, units, dim);
    // SAFETY: rows past `memory_rows` (cubes of an overshooting grid too) skip every access and
    // only join the barriers; query rows are clamped to `query_rows − 1`; vectors stay below
    // `vectors` within a row.
    unsafe {
        scores_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            args.vector_size,
            args.queries,
            args.memory,
            args.scores,
            args.query_rows,
            args.memory_rows,
            args.vectors,
            args.vector_size / 2,
            group,
            tile,
            args.metric == Metric::Hamming,
            args.pairwise,
            args.layout == WordLayout::Codes,
        )
    }
}

/// Arguments of one top-k pass over `rows × n` keys.
pub struct TopkArgs<R: Runtime> {
    pub keys: ArrayArg<R>,
    /// The keys' indices (`explicit`), else any binding: a key's index is its column.
    pub indices: ArrayArg<R>,
    pub explicit: bool,
    /// `rows × chunks × k` each, `chunks = ⌈n / TOPK_CHUNK⌉`.
    pub out_keys: ArrayArg<R>,
    pub out_indices: ArrayArg<R>,
}

/// One top-k pass: per row and chunk of [`TOPK_CHUNK`] keys, its `k ≤ TOPK_MAX_K` best (highest,
/// or lowest with `smallest`), ties to the lower index.
pub fn launch_topk<R: Runtime>(client: &ComputeClient<R>, rows: usize, n: usize, k: usize, smallest: bool, args: TopkArgs<R>) {
    let chunks = n.div_ceil(TOPK_CHUNK);
    if rows == 0 || chunks == 0 || k == 0 {
        return;
    }
    assert!(k <= TOPK_MAX_K, "kiln::trit top-k: k {k} above {TOPK_MAX_K}");
    // SAFETY: each cube reads its chunk of its row (positions checked against `n`) and writes its
    // own `k` outputs at `(row · chunks + chunk) · k`.
    unsafe {
        topk_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(chunks as u32, rows as u32, 1),
            CubeDim::new_1d(CUBE_UNITS as u32),
            args.keys,
            args.indices,
            args.out_keys,
            args.out_indices,
            n,
            chunks,
            k,
            args.explicit,
            smallest,
        )
    }
}
