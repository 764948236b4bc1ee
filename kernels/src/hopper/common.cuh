// Hopper building blocks shared by kiln's CUDA C++ kernels on warpgroup MMA (flash attention's
// `wgmma/`, the ternary GEMM and input gradient): shared-memory addresses, 16-byte `cp.async`
// copies, mbarriers for bulk copies, 2-D tensor copies (TMA) onto them, wgmma descriptors and synchronization, and the register
// fences that keep ptxas from moving values across an asynchronous MMA, and the sum of a k split
// over a thread-block cluster (`gather_splits`, with `KILN_CLUSTER` for the kernel's declaration), the stream-K schedule of
// the GEMMs (`for_each_segment`, with `publish_sums` and `gather_sums`), their grouped tile order (`grouped_tile`) and the barriers of warp-specialized cubes (`role_sync`, `makers_finish`). kiln places this file
// first, before a kernel's wrappers and source.
//
// A 128-byte-swizzled tile stores rows of 128 bytes: the 16-byte chunk `c` of row `r` sits at
// chunk `c ^ (r % 8)` of the row, the layout the descriptors' 128-byte swizzle mode names.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

// The cluster of a GEMM cube whose tile's reduction is split over KILN_SPLITS cubes (defined
// before this file; `gather_splits` sums them), for the kernel's declaration: none for one cube.
#if defined(KILN_SPLITS) && KILN_SPLITS > 1
#define KILN_CLUSTER __cluster_dims__(KILN_SPLITS, 1, 1)
#else
#define KILN_CLUSTER
#endif

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global → shared, zero-filled when `bytes` is 0.
__device__ __forceinline__ void copy16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// 4 bytes global → shared, zero-filled when `bytes` is 0 (rows of scales or statistics, which need
// no 16-byte alignment).
__device__ __forceinline__ void copy4(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// mbarriers on which bulk copies (`cp.async.bulk`, TMA) land: initialised by one thread before a
// cube barrier for `arrivals` arrivals a phase (by default one: the thread that issues the copies,
// announcing their bytes), then waited on by phase parity.
__device__ __forceinline__ void barrier_init(u32 bar, u32 arrivals = 1) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the barriers' initialisation visible to the async proxy that completes the copies.
__device__ __forceinline__ void barrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// The issuing thread's arrival, announcing the `bytes` its copies will complete.
__device__ __forceinline__ void barrier_expect(u32 bar, u32 bytes) {
    asm volatile("{ .reg .b64 s; mbarrier.arrive.expect_tx.shared::cta.b64 s, [%0], %1; }" ::"r"(bar), "r"(bytes) : "memory");
}

// A plain arrival (no bytes announced): a consumer releasing what the barrier guards.
__device__ __forceinline__ void barrier_arrive(u32 bar) {
    asm volatile("{ .reg .b64 s; mbarrier.arrive.shared::cta.b64 s, [%0]; }" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void barrier_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// A CUDA tensor map (`CUtensorMap`), opaque to the kernels; CubeCL encodes it at launch.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

// One 2-D tensor copy (TMA): the map's box at element column `col`, row `row` into shared memory
// at `dst`, its bytes completing on mbarrier `bar` (zeros where the box passes the tensor's end).
__device__ __forceinline__ void tensor_copy(u32 dst, const TensorMap* map, u32 col, u32 row, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst), "l"(map), "r"(col),
                 "r"(row), "r"(bar) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Makes this thread's generic-proxy writes to shared memory (cp.async) visible to wgmma.
__device__ __forceinline__ void async_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Matrix descriptor of a 128-byte-swizzled shared-memory operand.
__device__ __forceinline__ u64 descriptor(u32 address, u32 leading_bytes, u32 stride_bytes) {
    return (u64)((address & 0x3FFFF) >> 4) | ((u64)((leading_bytes >> 4) & 0x3FFF) << 16) |
           ((u64)((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// Keeps the compiler from moving reads or writes of the accumulators `d` across an asynchronous
// MMA's wait.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N>
__device__ __forceinline__ void fence_accumulators(int (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// Keeps register operands of an asynchronous MMA live up to this point (place it after the
// wgmma's wait): ptxas (CUDA 13.0) otherwise treats a register A operand as dead once the wgmma
// is issued and hands its registers to later values while the tensor cores still read them.
template <int N>
__device__ __forceinline__ void keep_operands(const u32 (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" ::"r"(r[i]) : "memory");
}

__device__ __forceinline__ u32 accumulator_bits(int v) { return (u32)v; }
__device__ __forceinline__ u32 accumulator_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ void add_accumulator_bits(int& a, u32 bits) { a += (int)bits; }
__device__ __forceinline__ void add_accumulator_bits(float& a, u32 bits) { a += __uint_as_float(bits); }

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Adds the accumulators of the other cubes of a tile whose k is split over a thread-block cluster
// of `splits` cubes (this one `rank`) to the first cube's, through distributed shared memory: each
// other cube stores its N accumulators in its own shared memory at `scratch` (free bytes, 4 N for
// each of the THREADS threads that hold accumulators), `acc[4j … 4j+3]` of accumulator thread `t`
// at 16-byte slot `j · THREADS + t`, and the first cube's thread `t` reads the same slots of each
// in rank order (so float sums are deterministic); the second cluster barrier keeps the others'
// shared memory alive until it has. Threads without accumulators take part in the barriers
// through `gather_splits_idle`. Returns whether this cube is done (not the tile's first).
template <int THREADS, typename T, int N>
__device__ __forceinline__ bool gather_splits(T (&acc)[N], u32 scratch, int rank, int splits, u32 t) {
    static_assert(N % 4 == 0, "whole 16-byte slots");
    const u32 slot = scratch + t * 16;
    if (rank != 0) {
        #pragma unroll
        for (int j = 0; j < N / 4; ++j)
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(slot + j * THREADS * 16), "r"(accumulator_bits(acc[4 * j])), "r"(accumulator_bits(acc[4 * j + 1])),
                         "r"(accumulator_bits(acc[4 * j + 2])), "r"(accumulator_bits(acc[4 * j + 3])) : "memory");
    }
    cluster_sync();
    if (rank == 0) {
        #pragma unroll 1
        for (int r = 1; r < splits; ++r) {
            u32 remote;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(slot), "r"(r));
            #pragma unroll
            for (int j = 0; j < N / 4; ++j) {
                u32 v[4];
                asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(remote + j * THREADS * 16) : "memory");
                #pragma unroll
                for (int e = 0; e < 4; ++e) add_accumulator_bits(acc[4 * j + e], v[e]);
            }
        }
    }
    cluster_sync();
    return rank != 0;
}

// `gather_splits` for a thread that holds no accumulators: its two cluster barriers.
__device__ __forceinline__ bool gather_splits_idle(int rank) {
    cluster_sync();
    cluster_sync();
    return rank != 0;
}

// Named barrier 1 over all THREADS threads of a cube whose warpgroups run different roles, each
// in its own loop (a branch on the role inside one loop makes ptxas serialize the wgmmas).
template <int THREADS>
__device__ __forceinline__ void role_sync() { asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory"); }

// The end of an operand-making warpgroup's part of a cube whose MMA warpgroups follow it with
// `role_sync`, the split's `gather_splits` (with SPLITS cubes a tile) and `role_sync` again once
// the output tile is staged: its copies done, then the same barriers. Returns whether this cube
// is done (not its tile's first).
template <int THREADS, int SPLITS>
__device__ __forceinline__ bool makers_finish(int rank) {
    copy_wait<0>();
    role_sync<THREADS>();  // the stages are free for the split sums and the output tile
    if (SPLITS > 1 && gather_splits_idle(rank)) return true;
    role_sync<THREADS>();  // the output tile is staged
    return false;
}

// Stream-K, for a GEMM of at least as many tiles as cubes (at most one cube an SM): each cube takes whole
// tiles for as many whole waves as leave between one and two waves' worth of tiles (in
// `grouped_tile`'s order: tile `w · grid + ticket` in wave `w`), then an equal share of those last
// tiles' reduction blocks, counted across tile boundaries. 172 tiles on 132 SMs then take 1.3
// tile-times, not two whole waves. A tile whose blocks fall to several cubes is finished by the
// one holding its first block (its owner): each other cube (a helper) leaves its sums in a global
// slot of its own and raises its flag, and the owner adds the slots to its own sums, in a fixed
// order, before its epilogue. No share starts fewer than 4 blocks from a tile's edge: a part of a
// few blocks costs a part's fixed time (its pipeline's start, its sums' store) for little work.
//
// Cubes are numbered by a ticket taken when they start (`take_ticket`), not by `blockIdx`, and
// the shares run in falling order of ticket: a tile's helpers hold later blocks, which come first
// in their own runs, and lower tickets, so an owner only ever waits on cubes that started before
// it. No wait can deadlock, however many cubes are resident at once, and a helper's flag is
// usually up long before its owner, at the end of its own run, looks.
//
// The launch's sync buffer holds the ticket counter (word 0) and one flag per ticket (words 1…):
// zero before a launch and zero again after it (the counter wraps at the grid's size, each flag
// is lowered by the owner that reads it), so one buffer serves every launch queued on a stream.
struct StreamK {
    u32 tiles;   // output tiles of the launch, no fewer than the grid's cubes
    u32 blocks;  // reduction blocks of a tile
};

// One cube's part of a tile: blocks `[kb0, kb0 + blocks)` of tile `tile` (in `grouped_tile`'s
// order). `helpers` counts the cubes (tickets `ticket − 1`, `ticket − 2`, …) that hold the
// tile's blocks past this part, for an owner; 0 otherwise.
struct Segment {
    u32 tile;
    int kb0, blocks, helpers;
    __device__ __forceinline__ bool helps() const { return kb0 > 0; }
};

// This cube's ticket: its rank in the order in which the launch's cubes started (thread 0 takes
// it; every thread of the cube gets it through `slot`, a shared word), or its index where the
// launch has a cube a tile and no cube waits on another (the atomic's round trip, ahead of the
// cube's first copies, cost such launches 5–9%). The barrier also publishes what the cube's
// threads wrote before it.
__device__ __forceinline__ u32 take_ticket(u32* sync, u32* slot, u32 tiles) {
    if (threadIdx.x == 0 && tiles > gridDim.x) *slot = atomicInc(sync, gridDim.x - 1);
    __syncthreads();
    return tiles > gridDim.x ? *slot : blockIdx.x;
}

// Where share `rank` of `shared` blocks (tiles of `blocks`) over `grid` cubes starts: its even
// start, moved to its tile's edge where that is fewer than 4 blocks away, for tiles of 8 blocks or
// more. Shares are longer than a tile, so even starts lie in distinct tiles, and two moved starts
// could meet at one edge only less than 8 blocks apart: no share is left empty.
__device__ __forceinline__ u64 share_start(u64 shared, u64 blocks, u32 rank, u32 grid) {
    const u64 even = shared * rank / grid, first = even / blocks * blocks;
    if (blocks < 8) return even;
    return even - first < 4 ? first : (first + blocks - even < 4 ? first + blocks : even);
}

// Calls `f(segment)` for each of ticket `ticket`'s parts of the launch, in order (see `StreamK`).
// One call site, so the segment's code (the whole main loop and epilogue) is inlined once: two
// copies, one for the whole waves and one for the shared blocks, doubled the kernel's code, and
// the first pass through the second copy waited on instruction fetches (17 µs a tile's epilogue).
template <typename F>
__device__ __forceinline__ void for_each_segment(const StreamK& s, u32 ticket, F f) {
    const u32 grid = gridDim.x, full = s.tiles / grid, waves = s.tiles % grid == 0 ? full : full - 1;
    const u64 blocks = s.blocks, shared = (u64)(s.tiles - waves * grid) * blocks;
    const u32 rank = grid - 1 - ticket;  // shares in falling order of ticket
    u64 at = 0, end = 0;
    if (shared > 0) {
        at = share_start(shared, blocks, rank, grid);
        end = share_start(shared, blocks, rank + 1, grid);
    }
    u32 wave = 0;
    #pragma unroll 1
    while (wave < waves || at < end) {
        Segment seg{wave * grid + ticket, 0, (int)blocks, 0};
        if (wave < waves) {
            ++wave;
        } else {
            const u64 tile = at / blocks, first = tile * blocks, stop = min(end, first + blocks);
            if (at == first)
                for (u32 r = rank + 1; share_start(shared, blocks, r, grid) < first + blocks; ++r) ++seg.helpers;
            seg.tile = waves * grid + (u32)tile;
            seg.kb0 = (int)(at - first);
            seg.blocks = (int)(stop - at);
            at = stop;
        }
        f(seg);
    }
}

// Named barrier 2 over the THREADS threads of a cube that hold accumulators.
template <int THREADS>
__device__ __forceinline__ void accumulators_sync() { asm volatile("bar.sync 2, %0;" ::"n"(THREADS) : "memory"); }

// A helper's sums: accumulator thread `t` stores `acc[4j … 4j+3]` at 16-byte unit `j · THREADS + t`
// of slot `ticket` (N · THREADS words a slot) and, once every thread has, thread 0 raises the
// slot's flag (a release at GPU scope, after the barrier: the owner's acquire then sees them all).
template <int THREADS, typename T, int N>
__device__ __forceinline__ void publish_sums(const T (&acc)[N], u32* slots, u32* sync, u32 ticket, u32 t) {
    static_assert(N % 4 == 0, "whole 16-byte units");
    u32* slot = slots + (u64)ticket * N * THREADS + 4 * t;
    #pragma unroll
    for (int j = 0; j < N / 4; ++j)
        asm volatile("st.global.cg.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(slot + 4 * j * THREADS), "r"(accumulator_bits(acc[4 * j])), "r"(accumulator_bits(acc[4 * j + 1])),
                     "r"(accumulator_bits(acc[4 * j + 2])), "r"(accumulator_bits(acc[4 * j + 3])) : "memory");
    accumulators_sync<THREADS>();
    if (t == 0) asm volatile("fence.acq_rel.gpu;\nst.relaxed.gpu.global.u32 [%0], 1;" ::"l"(sync + 1 + ticket) : "memory");
}

// An owner's gathering: for each of its `helpers` (tickets `ticket − 1` down), thread 0 waits for
// the helper's flag and lowers it, and every accumulator thread adds the helper's slot to its sums
// (in that order, so float sums are deterministic).
template <int THREADS, typename T, int N>
__device__ __forceinline__ void gather_sums(T (&acc)[N], const u32* slots, u32* sync, u32 ticket, int helpers, u32 t) {
    #pragma unroll 1
    for (int h = 1; h <= helpers; ++h) {
        const u32 helper = ticket - h;
        if (t == 0) {
            u32 up;
            do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(up) : "l"(sync + 1 + helper) : "memory");
            while (up == 0);
            asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(sync + 1 + helper) : "memory");
        }
        accumulators_sync<THREADS>();
        const u32* slot = slots + (u64)helper * N * THREADS + 4 * t;
        // Four 16-byte loads in flight before their sums (a helper's slot is read in about 2 µs).
        #pragma unroll
        for (int j = 0; j < N / 4; j += 4) {
            u32 v[4][4];
            #pragma unroll
            for (int q = 0; q < 4; ++q)
                asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v[q][0]), "=r"(v[q][1]), "=r"(v[q][2]), "=r"(v[q][3]) : "l"(slot + 4 * (j + q) * THREADS) : "memory");
            #pragma unroll
            for (int q = 0; q < 4; ++q)
                #pragma unroll
                for (int e = 0; e < 4; ++e) add_accumulator_bits(acc[4 * (j + q) + e], v[q][e]);
        }
    }
}

// The tile `(tok0, f0)` of a GEMM's `tile`-th output tile of TOKS activation rows by FEATS weight
// rows, `m` by `n` in all: tiles come in groups of GROUP activation tiles, the weight's tiles in
// order within a group, the group's activation tiles fastest, so the cubes in flight share a
// group's activations in L2 while the weight streams past.
template <int TOKS, int FEATS, int GROUP>
__device__ __forceinline__ void grouped_tile(u32 tile, u32 m, u32 n, u32& tok0, u32& f0) {
    const u32 tok_tiles = (m + TOKS - 1) / TOKS, feat_tiles = (n + FEATS - 1) / FEATS;
    const u32 per_group = GROUP * feat_tiles, group = tile / per_group;
    const u32 first = group * GROUP, size = min(GROUP, tok_tiles - first), within = tile % per_group;
    tok0 = (first + within % size) * TOKS;
    f0 = (within / size) * FEATS;
}
