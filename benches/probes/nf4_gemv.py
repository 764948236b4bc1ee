"""The NF4 tensor-core GEMV (`kernels/src/nf4/gemv.cu`) and edited copies of it, without a Rust
build: each `.cu` is compiled by NVRTC through CuPy with the defines `mma.rs` passes (bf16,
double-quantized scales), run on random codes, checked against an f64 reference (max error) and
against the first file (bit-identical or not), and timed like `benches/peers/gemm.py`'s
`gpu_seconds` (CUDA events, calls queued behind `torch.cuda._sleep`), next to bitsandbytes (if
importable) and torch bf16 in the same process. The thirty-second session tuned the kernel with it;
the forty-seventh took it apart on the H200 with `--ablate`.

Usage on the GPU machine, from the repository root:
    python3 benches/probes/nf4_gemv.py [--sass] [--ablate] [variant.cu ...]   (default: the committed kernel)
Environment: SHAPES (k x n list, default the issue's four), ROWS (default 1,8). A variant may set
its launch geometry with header lines `// probe: WARPS=4` (also UNROLL, STAGES, TEAMS, TABLE,
RESIDENT: cubes an SM; SHARED: its dynamic shared bytes), and `// probe: LAYOUT=tiled` hands it the packed weight re-tiled so that
each tile's group of four spans (16 rows of 128 bytes) is one contiguous run (for a variant whose
copies read that layout; the committed kernel's outputs are then wrong). `--ablate` adds the
committed kernel with one part taken out (`ABLATIONS`: the products, the scale loads, the table
lookups, the MMAs), whose outputs are wrong by design: timing only. `--sass` writes each
variant's SASS (nvcc, sm_90) to $OUT and prints its instruction count."""
import os, sys, re, subprocess
import numpy as np
import cupy as cp
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from gemm import gpu_seconds  # noqa: E402  (CUDA events behind torch.cuda._sleep)

SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SHAPES", "8192x28672,4096x11008,11008x4096,4096x4096").split(",")]
ROWS = [int(r) for r in os.environ.get("ROWS", "1,8").split(",")]
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0]
SMS = torch.cuda.get_device_properties(0).multi_processor_count
SMEM = 232448


def patch(src):
    sig = "const __grid_constant__ Params p) {"
    assert sig in src
    return src.replace(sig, "unsigned p_n, unsigned p_k, unsigned p_block, unsigned p_tiles) {\n    const Params p{p_n, p_k, p_block, p_tiles};")


def tiling(spans, env):
    unroll = int(env.get("UNROLL", 4))
    useful = 1 << (max(1, -(-spans // unroll)) - 1).bit_length()
    warps = int(env.get("WARPS", min(useful, 8)))
    stages = int(env.get("STAGES", 3))
    return warps, unroll, stages


# Parts of the committed kernel that `--ablate` replaces, one variant each: (name, kernel text,
# replacement). The replaced text must be in the kernel (an edit to it fails here, loudly).
ABLATIONS = [
    ("copies", """            if (first + KILN_UNROLL <= spans) {
#pragma unroll
                for (int u = 0; u < KILN_UNROLL; ++u) span(u);
            } else {
#pragma unroll
                for (int u = 0; u < KILN_UNROLL; ++u)
                    if (first + u < spans) span(u);
            }""", "            acc[0] += cur0 + cur1 + (float)first; (void)at; (void)span;"),
    ("noscale", """                own0 = scales.get((size_t)min(s_tile * 16 + g, p.n - 1) * blocks_per_row + b);
                own1 = scales.get((size_t)min(s_tile * 16 + g + 8, p.n - 1) * blocks_per_row + b);""",
     "                own0 = 1.f + b * 1e-9f; own1 = 1.f;"),
    ("nolookup", "    return kiln_lds(lane_table + (__byte_perm(word, 0, 0x4440 + b) << 7));",
     "    return __byte_perm(word, 0, 0x4440 + b) * 0x00010001u + (lane_table & 1);"),
    ("nomma", """                    if (st == 0) kiln_mma_first(c, a, xb.x, xb.y);
                    else kiln_mma(c, a, st % 2 ? xb.z : xb.x, st % 2 ? xb.w : xb.y);""",
     """                    if (st == 0) { c[0] = __uint_as_float(a[0] ^ xb.x); c[1] = __uint_as_float(a[1]); c[2] = __uint_as_float(a[2]); c[3] = __uint_as_float(a[3] ^ xb.y); }
                    else { c[0] += __uint_as_float(a[0] ^ xb.z); c[1] += __uint_as_float(a[1]); c[2] += __uint_as_float(a[2]); c[3] += __uint_as_float(a[3] ^ xb.w); }"""),
]


def ablations(path):
    text = open(path).read()
    for name, part, replacement in ABLATIONS:
        assert part in text, f"--ablate {name}: the kernel no longer has the part it replaces"
        yield Variant(f"gemv.cu-{name}", text.replace(part, replacement))


class Variant:
    def __init__(self, name, text):
        self.name = name
        # Optional header lines "// probe: KEY=VALUE" set the launch geometry of the variant.
        self.env = dict(re.findall(r"^// probe: (\w+)=(\S+)", text, re.M))
        # `KILN_OUT_KIND` and the output element kiln places before the source (bf16 here).
        out = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels", "src", "cuda_out.cuh")).read()
        self.src = "#define KILN_OUT_KIND 2\n" + out + patch(text)
        self.layout = self.env.get("LAYOUT", "rows")
        self.table = int(self.env.get("TABLE", 256 * 32 * 4))
        self.teams = int(self.env.get("TEAMS", 1))
        self.cache = {}

    def kernel(self, rows, warps, unroll, stages, resident):
        key = (rows, warps, unroll, stages, resident)
        if key not in self.cache:
            defs = f"#define KILN_TEAMS {self.teams}\n#define KILN_ROWS {rows}\n#define KILN_KIND 2\n#define KILN_WARPS {warps}\n#define KILN_NESTED 1\n#define KILN_UNROLL {unroll}\n#define KILN_STAGES {stages}\n#define KILN_MIN_BLOCKS {resident}\n"
            mod = cp.RawModule(code=defs + self.src, options=("-std=c++17", "-arch=sm_90"), name_expressions=None)
            self.cache[key] = mod.get_function("kiln_nf4_gemv_mma")
        return self.cache[key]

    def launch(self, rows, n, k, bufs, stream):
        spans = k // 64
        warps, unroll, stages = tiling(spans, self.env)
        shared = int(self.env["SHARED"]) if "SHARED" in self.env else self.table + self.teams * warps * stages * 16 * (32 * unroll + 32)
        fixed = 2 * self.teams * warps * 4 * 32 * 4
        resident = int(self.env.get("RESIDENT", max(1, min(24 // (warps * self.teams), SMEM // (shared + fixed + 1024)))))
        f = self.kernel(rows, warps, unroll, stages, resident)
        f.max_dynamic_shared_size_bytes = shared
        tiles = -(-n // 16)
        cubes = min(-(-tiles // self.teams), SMS * resident)
        u = np.uint32
        f((cubes,), (32 * warps * self.teams,), bufs + (u(n), u(k), u(64), u(tiles)), shared_mem=shared, stream=stream)


def data(k, n, seed=0):
    rng = np.random.default_rng(seed)
    blocks = n * k // 64
    words = cp.asarray(rng.integers(0, 256, size=n * k // 2, dtype=np.uint8))
    qcodes = rng.integers(0, 256, size=blocks, dtype=np.uint8)
    qpad = np.zeros(-(-blocks // 4) * 4, np.uint8)
    qpad[:blocks] = qcodes
    absmax_codes = cp.asarray(qpad.view(np.uint32))
    nested_code = cp.asarray(np.sort(rng.uniform(-1, 1, 256)).astype(np.float32))
    nested_absmax = cp.asarray(rng.uniform(0.01, 0.03, -(-blocks // 256)).astype(np.float32))
    offset = cp.asarray(np.array([0.02], np.float32))
    code = cp.asarray(np.array(NF4, np.float32))
    x = cp.asarray(rng.standard_normal((max(ROWS), k)).astype(np.float32))
    return dict(words=words, qcodes=cp.asarray(qcodes), absmax_codes=absmax_codes, nested_code=nested_code,
                nested_absmax=nested_absmax, offset=offset, code=code, x=x)


def tiled(words, n, k, unroll):
    """The packed `[n, k / 2]` bytes with each tile's group of `unroll` spans (16 rows of 32 ·
    unroll bytes) one contiguous run, tiles outermost (`LAYOUT=tiled`)."""
    g = unroll * 32
    assert n % 16 == 0 and (k // 2) % g == 0, "LAYOUT=tiled takes whole tiles and groups"
    return cp.ascontiguousarray(words.reshape(n // 16, 16, k // 2 // g, g).transpose(0, 2, 1, 3)).reshape(-1)


def to_bf16_bits(a):
    t = torch.as_tensor(a, device="cuda").to(torch.bfloat16)
    return cp.asarray(t.view(torch.int16)).view(cp.uint16), cp.asarray(t.float())


def reference(d, k, n, rows, xf):
    code_h = cp.asarray(torch.as_tensor(d["code"], device="cuda").to(torch.bfloat16).double())
    w = d["words"].reshape(n, k // 2)
    hi, lo = (w >> 4).astype(cp.int32), (w & 15).astype(cp.int32)
    q = cp.stack([hi, lo], axis=2).reshape(n, k)
    blocks = cp.arange(n * k // 64)
    scale = d["nested_code"][d["qcodes"].astype(cp.int32)].astype(cp.float64) * d["nested_absmax"][blocks // 256] + d["offset"][0]
    W = code_h[q] * cp.repeat(scale.reshape(n, k // 64), 64, axis=1)
    return xf[:rows].astype(cp.float64) @ W.T


def peers(k, n, rows):
    out = {}
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out["torch"] = gpu_seconds(lambda: x @ w.t())
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F
        q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        out["bnb"] = gpu_seconds(lambda: bnb.matmul_4bit(x, q.t(), quant_state=state))
    except Exception as err:  # noqa: BLE001
        print("bnb unavailable:", err)
    return out


def sass(v):
    tmp = f"/tmp/{v.name}.cu"
    open(tmp, "w").write(f"#define KILN_TEAMS {v.teams}\n" + "#define KILN_ROWS 1\n#define KILN_KIND 2\n#define KILN_WARPS 8\n#define KILN_NESTED 1\n#define KILN_UNROLL 4\n#define KILN_STAGES 3\n#define KILN_MIN_BLOCKS 2\n" + v.src)
    out = os.environ.get("OUT", "/tmp")
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-o", f"/tmp/{v.name}.cubin", tmp], check=True)
    s = subprocess.run(["cuobjdump", "-sass", f"/tmp/{v.name}.cubin"], capture_output=True, text=True).stdout
    open(f"{out}/{v.name}.sass", "w").write(s)
    count = sum(1 for l in s.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l))
    print(f"sass {v.name}: {count} instructions")


def main():
    args = sys.argv[1:]
    do_sass = "--sass" in args
    paths = [a for a in args if a.endswith(".cu")]
    here = os.path.dirname(os.path.abspath(__file__))
    committed = os.path.join(here, "..", "..", "kernels", "src", "nf4", "gemv.cu")
    variants = [Variant(os.path.basename(a), open(a).read()) for a in paths or [committed]]
    if "--ablate" in args:
        variants += list(ablations(committed))
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)  # torch's stream, behind its sleep
    if do_sass:
        for v in variants:
            sass(v)
    for k, n in SHAPES:
        d = data(k, n)
        xbits, xf = to_bf16_bits(d["x"])
        mbytes = n * k // 2 + n * k // 64 + 4 * (n * k // 64 // 256)
        for rows in ROWS:
            ref = reference(d, k, n, rows, xf)
            first = None
            line = f"k{k} n{n} m{rows}:"
            for v in variants:
                out = cp.full((rows, n), 0x7fc0, dtype=cp.uint16)  # poison: bf16 NaN
                words = tiled(d["words"], n, k, tiling(k // 64, v.env)[1]) if v.layout == "tiled" else d["words"]
                bufs = (xbits, words, d["code"], d["nested_absmax"], d["absmax_codes"], d["nested_code"], d["offset"], out)
                with stream:
                    v.launch(rows, n, k, bufs, stream)
                stream.synchronize()
                got = cp.asarray(torch.as_tensor(out.view(cp.int16), device="cuda").view(torch.bfloat16).double())
                err = float(cp.abs(got - ref).max())
                same = "" if first is None else (" =" if bool((out == first).all()) else " DIFF")
                first = out if first is None else first
                with stream:
                    t = gpu_seconds(lambda: v.launch(rows, n, k, bufs, stream))
                line += f" | {v.name} {t * 1e6:6.1f} us {mbytes / t / 1e9:5.0f} GB/s err {err:.3g}{same}"
            p = peers(k, n, rows)
            line += " | " + " ".join(f"{a} {b * 1e6:6.1f} us" for a, b in p.items()) + f" | max|ref| {float(cp.abs(ref).max()):.3g}"
            print(line, flush=True)
        del d
        cp.get_default_memory_pool().free_all_blocks()


main()
