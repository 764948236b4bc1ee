"""The fused ternary W2A8 GEMV (`kiln_ternary_gemv_fused` in `kernels/src/ternary/gemv.cu`) and
edited copies of it, without a Rust build: each `.cu` is compiled by NVRTC through CuPy for one
bf16 activation row, checked bit-exactly against a NumPy model of the kernel's arithmetic
(int8 activation codes, integer sums, one division), and timed like `benches/peers/gemm.py`'s
`gpu_seconds` next to torch bf16 in the same process. The launch follows `dp4a.rs`' fused
launch with the old tiling rule (threads for about two vectors, one feature below 4096); a
variant overrides it with header lines `// probe: T=16` / `// probe: FPT=2`.

Usage on the GPU machine, from the repository root:
    python3 benches/probes/ternary_gemv.py [variant.cu ...]   (default: the committed kernel)
Environment: SHAPES (`n`x`k` list, default BitNet's and two Llama shapes)."""
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
    threads = int(env.get("T", min(32, max(4, 1 << (-(-kv // 2) - 1).bit_length()))))
    features = int(env.get("FPT", 1 if n < 4096 else 2))
    return threads, features


class Variant:
    def __init__(self, path):
        self.name = os.path.basename(path)
        text = open(path).read()
        self.env = dict(re.findall(r"^// probe: (\w+)=(\S+)", text, re.M))
        sig = "const __grid_constant__ FusedParams p) {"
        assert sig in text
        out = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels", "src", "cuda_out.cuh")).read()
        self.src = out + text.replace(sig, "unsigned p_n, unsigned p_kv, unsigned p_group, unsigned p_k, unsigned p_it) {\n    const FusedParams p{{p_n, p_kv, p_group}, p_k, p_it};")
        self.cache = {}

    def launch(self, n, k, bufs, stream):
        kv = -(-k // 64)
        threads, features = tiling(n, kv, self.env)
        key = (threads, features)
        if key not in self.cache:
            defs = f"#define KILN_ROWS 1\n#define KILN_T {threads}\n#define KILN_FPT {features}\n#define KILN_OUT_KIND 2\n#define KILN_IN_KIND 2\n"
            self.cache[key] = cp.RawModule(code=defs + self.src, options=("-std=c++17", "-arch=sm_90")).get_function("kiln_ternary_gemv_fused")
        f = self.cache[key]
        shared = kv * 64
        f.max_dynamic_shared_size_bytes = shared
        resident = max(1, min(2048 // CUBE, SMEM // (shared + 1024)))
        needed = -(-(-(-n // features) * threads) // CUBE)
        iterations = -(-needed // (resident * SMS))
        cubes = -(-needed // iterations)
        u = np.uint32
        f((cubes,), (CUBE,), bufs + (u(n), u(kv), u(n), u(k), u(iterations)), shared_mem=shared, stream=stream)


def pack(codes, n, kv):
    # element e = 64 v + 16 j + 4 s + b of a row -> word 4 v + j, bits 8 b + 2 s
    c = codes.reshape(n, kv, 4, 4, 4).astype(np.uint32)  # v, j, s, b
    shifts = (8 * np.arange(4)[None, None, None, None, :] + 2 * np.arange(4)[None, None, None, :, None]).astype(np.uint32)
    words = (c << shifts).sum(axis=(3, 4)).astype(np.uint32)  # n, kv, 4
    return words.reshape(n, kv * 4)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    paths = sys.argv[1:] or [os.path.join(here, "..", "..", "kernels", "src", "ternary", "gemv.cu")]
    variants = [Variant(a) for a in paths]
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    rng = np.random.default_rng(0)
    for n, k in SHAPES:
        kv = -(-k // 64)
        codes = rng.integers(0, 3, size=(n, kv * 64), dtype=np.int64)
        codes[:, k:] = 1  # padding: weight 0
        words = cp.asarray(pack(codes, n, kv))
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
            with stream:
                t = gpu_seconds(lambda: v.launch(n, k, bufs, stream))
            line += f" | {v.name} {t * 1e6:5.1f} us {w_bytes / t / 1e9:5.0f} GB/s {'exact' if bad == 0 else f'{bad} WRONG'}"
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        tt = gpu_seconds(lambda: xt @ w.t())
        line += f" | torch {tt * 1e6:5.1f} us"
        print(line, flush=True)
        del w


main()
