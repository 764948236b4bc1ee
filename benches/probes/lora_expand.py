"""LoRA's input gradient in one pass (`kernels/src/lora/expand.cu`: `dx = dropout(dh·A) + prior`)
without a Rust build: compiled by NVRTC through CuPy with the defines kiln passes, checked against
an f64 reference with poisoned (NaN) outputs (max error next to torch's own product's error), and
timed with CUDA events behind a busy GPU (`benches/peers/gemm.py`'s `gpu_seconds`) next to torch
(cuBLAS: the product, `addmm` with the prior, or the product, mask and add) in the same process.
The fiftieth session tuned the kernel with it (its forward `y = base + s·h·Bᵀ` variant then ran
1.9–2.3× torch's `addmm` here but slower than kiln's cuBLASLt in whole steps).

Usage on the GPU machine, from the repository root:
    python3 benches/probes/lora_expand.py [variant.cu ...]   (default: the committed kernel)
Environment: SHAPES (tokens x n x r list), CTAS (cubes an SM the grid is sized for, default 8),
KIND (bf16 or f16)."""
import os, sys
import cupy as cp
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
from gemm import gpu_seconds  # noqa: E402

SRC = os.path.join(HERE, "..", "..", "kernels", "src")
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SHAPES", "4096x4096x16,4096x11008x16,16384x4096x16,4096x4096x8,4096x4096x64,300x1000x24").split(",")]
CTAS = int(os.environ.get("CTAS", 8))
WARPS = 4  # expand.cu's KILN_WARPS
SMS = torch.cuda.get_device_properties(0).multi_processor_count
KIND = os.environ.get("KIND", "bf16")
DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16}[KIND]
# Dropout: a fixed key and p = 0.1 (the kernel's hash is checked against this host copy).
KEY, P = 0x1234567, 0.1
THRESHOLD = round(P * 2**32)


def mix32(h):
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def keep_mask(tokens, n):
    i = np.arange(tokens * n, dtype=np.uint64) ^ np.uint64(KEY)
    return torch.from_numpy((mix32(i) >= THRESHOLD).reshape(tokens, n)).cuda()


class Variant:
    def __init__(self, path):
        self.name = os.path.basename(path)
        text = open(path).read()
        sig = "const __grid_constant__ ExpandParams p) {"
        assert sig in text
        self.text = text.replace(sig, "u32 q0, u32 q1, float q2, u32 q3, u32 q4, float q5) {\n    const ExpandParams p{q0, q1, q2, q3, q4, q5};")
        self.head = open(os.path.join(SRC, "hopper", "common.cuh")).read() + "\n" + open(os.path.join(SRC, "cuda_out.cuh")).read() + "\n" + open(os.path.join(SRC, "lora", "mma.cuh")).read()
        self.kind = 1 if KIND == "f16" else 2
        self.cache = {}

    def function(self, r, dropout, residual):
        key = (r, dropout, residual)
        if key not in self.cache:
            defs = f"#define KILN_KIND {self.kind}\n#define KILN_OUT_KIND {self.kind}\n#define KILN_R {r}\n#define KILN_DROPOUT {int(dropout)}\n#define KILN_RESIDUAL {int(residual)}\n"
            mod = cp.RawModule(code=defs + self.head + "\n" + self.text, options=("-std=c++17", "-arch=sm_90"))
            self.cache[key] = mod.get_function("kiln_lora_expand")
        return self.cache[key]

    def run(self, l, rt, c, out, scale, dropout):
        tokens, r = l.shape
        n = out.shape[1]
        f = self.function(r, dropout, c is not None)
        u = np.uint32
        v = lambda t: cp.asarray(t.view(torch.int16))
        columns, tiles = -(-n // (64 * WARPS)), -(-tokens // 16)
        grid = (columns, min(tiles, -(-SMS * CTAS // columns)))
        with cp.cuda.Stream.from_external(torch.cuda.current_stream()):
            f(grid, (32 * WARPS,), (v(l), v(rt), v(c if c is not None else out), v(out), u(tokens), u(n), np.float32(scale), u(KEY), u(THRESHOLD), np.float32(1 / (1 - P))))
        return out


def main():
    paths = sys.argv[1:] or [os.path.join(SRC, "lora", "expand.cu")]
    variants = [Variant(p) for p in paths]
    err = lambda x, ref: ((x.double() - ref).abs().max() / ref.abs().max()).item()
    for tokens, n, r in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(tokens + n + r)
        rand = lambda *shape, std=1.0: (torch.randn(*shape, device="cuda", generator=g) * std).to(DTYPE)
        l, a_kn, c = rand(tokens, r), rand(r, n, std=0.25), rand(tokens, n)
        mask = keep_mask(tokens, n)
        # (name, residual, dropout): `dx` alone, with the prior, and with both.
        cases = [("dx = dh·A", None, False), ("dx = dh·A + prior", c, False), ("dx = dropout(dh·A) + prior", c, True)]
        for name, res, drop in cases:
            r_kn, scale = a_kn, 1.0
            ref = scale * (l.double() @ r_kn.double())
            if drop:
                ref = torch.where(mask, ref / (1 - P), torch.zeros_like(ref))
            if res is not None:
                ref = ref + res.double()
            if res is not None and not drop:
                peer_out = torch.addmm(res, l, r_kn, alpha=scale)
                peer = gpu_seconds(lambda: torch.addmm(res, l, r_kn, alpha=scale), calls=100)
            else:
                peer_out = scale * (l @ r_kn)
                if drop:
                    keep = mask.to(DTYPE) / (1 - P)
                    peer_out = peer_out * keep + (res if res is not None else 0)
                    peer = gpu_seconds(lambda: torch.add(torch.mm(l, r_kn) * keep, res), calls=100)
                else:
                    peer = gpu_seconds(lambda: torch.mm(l, r_kn), calls=100)
            moved = tokens * n * 2 * (2 if res is not None else 1)
            print(f"lora-expand {KIND} tokens {tokens} n {n} r {r} {name}: torch {peer * 1e6:.1f} us ({moved / peer / 1e9:.0f} GB/s), rel err {err(peer_out, ref):.2e}", flush=True)
            for v in variants:
                out = torch.full((tokens, n), float("nan"), device="cuda", dtype=DTYPE)
                v.run(l, a_kn, res, out, scale, drop)
                torch.cuda.synchronize()
                e = err(out, ref)
                ok = e <= 2 * err(peer_out, ref) + 8e-3
                t = gpu_seconds(lambda: v.run(l, a_kn, res, out, scale, drop), calls=100)
                print(f"  {v.name}: {t * 1e6:.1f} us ({peer / t:.2f}x torch, {moved / t / 1e9:.0f} GB/s), rel err {e:.2e} {'ok' if ok else 'FAILED'}", flush=True)
        del l, a_kn, c, mask
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
