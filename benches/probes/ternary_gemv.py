"""The fused ternary W2A8 GEMV (`kiln_ternary_gemv_fused` in `kernels/src/ternary/gemv.cu`) and
edited copies of it, without a Rust build: each `.cu` is compiled by NVRTC through CuPy for one
bf16 activation row, checked bit-exactly against a NumPy model of the kernel's arithmetic
(int8 activation codes, integer sums, one division), and timed like `benches/peers/gemm.py`'s
`gpu_seconds` next to torch bf16 and a plain read of the packed weight in the same process.
The launch follows `dp4a.rs`' fused launch (its tiling rule and cube size).

Usage on the GPU machine, from the repository root:
    python3 benches/probes/ternary_gemv.py [variant.cu[:KEY=value…] ...]
(default: the committed kernel's fused entry; see `Variant` for the keys).
Environment: SHAPES (`n`x`k` list, default BitNet's and two Llama shapes); ROTATE (copies of
the weight the timed calls cycle through, so that a weight smaller than L2 is read from HBM)."""
import os, sys, re
import numpy as np
import cupy as cp
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from gemm import gpu_seconds  # noqa: E402  (CUDA events behind torch.cuda._sleep)

SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get(
    "SHAPES", "2560x2560,13824x2560,2560x6912,3200x10240,20480x3200,11008x4096,28672x8192").split(",")]
SMS = torch.cuda.get_device_properties(0).multi_processor_count
SMEM = 232448
CUBE = 256


def tiling(n, kv, env):
    """`dp4a.rs`' one-row rule: about four vectors a thread and two features, then one feature,
    then more threads, until the threads fill a cube an SM."""
    threads, features = min(32, max(4, 1 << max(kv // 4, 1).bit_length() - 1)), 2
    while -(-n // features) * threads < SMS * CUBE and (features > 1 or threads < 32):
        features, threads = (1, threads) if features > 1 else (features, threads * 2)
    return int(env.get("T", threads)), int(env.get("FPT", features))


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def read(*parts):
    return open(os.path.join(ROOT, *parts)).read()


def fused_cube(kv):
    """`dp4a.rs`' cube for the fused entry: one quarter a thread up to 256, two at 512, then 1024."""
    return 256 if 4 * kv <= 256 else 512 if 4 * kv <= 1024 else 1024


class Variant:
    """`path[:KEY=value…]`: keys override the launch (T threads a row, FPT features a thread,
    CUBE threads a cube), as header lines `// probe: KEY=value` in the file do."""

    def __init__(self, arg):
        path, *opts = arg.split(":")
        self.name = os.path.basename(path) + "".join(f":{o}" for o in opts)
        text = open(path).read()
        self.env = dict(re.findall(r"^// probe: (\w+)=(\S+)", text, re.M))
        self.env.update(o.split("=", 1) for o in opts)
        sig = "const __grid_constant__ FusedParams p) {"
        assert sig in text
        self.src = read("kernels", "src", "cuda_out.cuh") + text.replace(sig, "unsigned p_n, unsigned p_kv, unsigned p_group, unsigned p_k, unsigned p_it) {\n    const FusedParams p{{p_n, p_kv, p_group}, p_k, p_it};")
        self.cache = {}

    def launch(self, n, k, bufs, stream):
        kv = -(-k // 64)
        threads, features = tiling(n, kv, self.env)
        cube = int(self.env.get("CUBE", fused_cube(kv)))
        key = (threads, features, cube)
        if key not in self.cache:
            defs = f"#define KILN_ROWS 1\n#define KILN_T {threads}\n#define KILN_FPT {features}\n#define KILN_OUT_KIND 2\n#define KILN_IN_KIND 2\n#define KILN_CUBE {cube}\n"
            self.cache[key] = cp.RawModule(code=defs + self.src, options=("-std=c++17", "-arch=sm_90")).get_function("kiln_ternary_gemv_fused")
        f = self.cache[key]
        shared = kv * 64
        f.max_dynamic_shared_size_bytes = shared
        resident = max(1, min(2048 // cube, SMEM // (shared + 1024)))
        needed = -(-(-(-n // features) * threads) // cube)
        iterations = -(-needed // (resident * SMS))
        cubes = -(-needed // iterations)
        u = np.uint32
        f((cubes,), (cube,), bufs + (u(n), u(kv), u(n), u(k), u(iterations)), shared_mem=shared, stream=stream)


# The read ceiling: every 16-byte vector of `words` loaded once (grid-stride, eight in flight a
# thread), folded by XOR, and one word written a cube only if the fold is a value it never is.
READ = cp.RawKernel(r"""
extern "C" __global__ void __launch_bounds__(512) read_words(const uint4* __restrict__ w, unsigned long long vectors, unsigned* out) {
    unsigned f = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i + 7 * stride < vectors; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __ldcs(w + i + j * stride);
#pragma unroll
        for (int j = 0; j < 8; ++j) f ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < vectors; i += stride) { const uint4 v = __ldcs(w + i); f ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (f == 0x9e3779b9u) out[blockIdx.x] = f;
}
""", "read_words")


def pack(codes, n, kv):
    # element e = 64 v + 16 j + 4 s + b of a row -> word 4 v + j, bits 8 b + 2 s
    c = codes.reshape(n, kv, 4, 4, 4).astype(np.uint32)  # v, j, s, b
    shifts = (8 * np.arange(4)[None, None, None, None, :] + 2 * np.arange(4)[None, None, None, :, None]).astype(np.uint32)
    words = (c << shifts).sum(axis=(3, 4)).astype(np.uint32)  # n, kv, 4
    return words.reshape(n, kv * 4)


def main():
    variants = [Variant(a) for a in sys.argv[1:] or [os.path.join(ROOT, "kernels", "src", "ternary", "gemv.cu")]]
    rotate = int(os.environ.get("ROTATE", "1"))
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    rng = np.random.default_rng(0)
    for n, k in SHAPES:
        kv = -(-k // 64)
        codes = rng.integers(0, 3, size=(n, kv * 64), dtype=np.int64)
        codes[:, k:] = 1  # padding: weight 0
        copies = [cp.asarray(pack(codes, n, kv)) for _ in range(rotate)]
        words = copies[0]
        sw = np.float32(rng.uniform(0.5, 2.0))
        w_scales = cp.asarray(np.array([sw], np.float32))
        xt = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        xbits = cp.asarray(xt.view(torch.int16)).view(cp.uint16)
        xf = xt.float().cpu().numpy()[0]
        m = np.float32(np.max(np.abs(xf)))
        s = np.float32(127.0) / np.maximum(m, np.float32(1e-5))
        c = np.clip(np.rint(xf * s), -128, 127).astype(np.int64)
        acc = codes[:, :k] @ c
        ref = ((acc - c.sum()).astype(np.float32) / (s * sw)).astype(np.float32)
        ref_bf = torch.from_numpy(ref).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        w_bytes = n * kv * 16
        line = f"n{n} k{k}:"
        for v in variants:
            out = cp.full((1, n), 0x7fc0, dtype=cp.uint16)
            bufs = (xbits, words, w_scales, out)
            with stream:
                v.launch(n, k, bufs, stream)
            stream.synchronize()
            bad = int((cp.asnumpy(out[0]) != ref_bf).sum())
            turn = iter(range(1 << 62))
            with stream:
                t = gpu_seconds(lambda: v.launch(n, k, (xbits, copies[next(turn) % rotate], w_scales, out), stream))
            line += f" | {v.name} {t * 1e6:5.1f} us {w_bytes / t / 1e9:5.0f} GB/s {'exact' if bad == 0 else f'{bad} WRONG'}"
        sink = cp.zeros(4096, dtype=cp.uint32)
        turn = iter(range(1 << 62))
        with stream:
            t = gpu_seconds(lambda: READ((4 * SMS,), (512,), (copies[next(turn) % rotate], np.uint64(n * kv), sink), stream=stream))
        line += f" | read {t * 1e6:5.1f} us {w_bytes / t / 1e9:5.0f} GB/s"
        del copies
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        tt = gpu_seconds(lambda: xt @ w.t())
        line += f" | torch {tt * 1e6:5.1f} us"
        print(line, flush=True)
        del w


main()
