"""LoRA's fused `dy` products (`kernels/src/lora/dy.cu`: `dh = s·dy·B`, `dB = s·dyᵀ·h` in one read
of `dy`) without a Rust build: compiled by NVRTC through CuPy with the defines `lora/dy.rs`
passes, checked against an f64 reference (max error, next to torch's own bf16 products' error),
and timed with CUDA events behind a busy GPU (`benches/peers/gemm.py`'s `gpu_seconds`) next to
torch's two products (cuBLAS) in the same process: both launches, and each alone. Outputs are
poisoned (NaN) before the checked run. The forty-ninth session tuned the kernel with it.

Usage on the GPU machine, from the repository root:
    python3 benches/probes/lora_dy.py [variant.cu ...]   (default: the committed kernel)
Environment: SHAPES (tokens x out x r list), STAGES (default 3), SPLITS (cubes per token tile;
default: about one cube an SM), KIND (bf16 or f16)."""
import os, sys
import cupy as cp
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
from gemm import gpu_seconds  # noqa: E402

SRC = os.path.join(HERE, "..", "..", "kernels", "src")
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SHAPES", "4096x4096x16,4096x11008x16,4096x4096x64,16384x4096x16,4096x4096x8,1000x4104x24").split(",")]
STAGES = int(os.environ.get("STAGES", 3))
KIND = os.environ.get("KIND", "bf16")
DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16}[KIND]
SMS = torch.cuda.get_device_properties(0).multi_processor_count
TOKENS, CHUNK = 256, 64  # dy.cu's KILN_TOKENS and KILN_CHUNK


def source(path):
    text = open(path).read()
    sig = "const __grid_constant__ Params p) {"
    assert sig in text
    text = text.replace(sig, "u32 p_tokens, u32 p_out, u32 p_chunks, u32 p_per_split) {\n    const Params p{p_tokens, p_out, p_chunks, p_per_split};")
    sig = "const __grid_constant__ SumParams p) {"
    assert sig in text
    text = text.replace(sig, "u32 q0, u32 q1, u32 q2, u32 q3, float q4) {\n    const SumParams p{q0, q1, q2, q3, q4};")
    kind = 1 if KIND == "f16" else 2
    head = open(os.path.join(SRC, "hopper", "common.cuh")).read() + "\n" + open(os.path.join(SRC, "cuda_out.cuh")).read() + "\n" + open(os.path.join(SRC, "lora", "mma.cuh")).read()
    return kind, head, text


class Variant:
    def __init__(self, path):
        self.name = os.path.basename(path)
        self.kind, self.head, self.text = source(path)
        self.cache = {}

    def functions(self, nj):
        if nj not in self.cache:
            defs = f"#define KILN_KIND {self.kind}\n#define KILN_OUT_KIND {self.kind}\n#define KILN_NJ {nj}\n#define KILN_STAGES {STAGES}\n"
            mod = cp.RawModule(code=defs + self.head + "\n" + self.text, options=("-std=c++17", "-arch=sm_90"))
            self.cache[nj] = (mod.get_function("kiln_lora_dy"), mod.get_function("kiln_lora_dy_sum"))
        return self.cache[nj]

    def plan(self, tokens, out, r):
        nj = r // 8
        chunk = CHUNK
        shared = STAGES * (TOKENS * (chunk + 8) * 2 + chunk * (r + 8) * 2) + TOKENS * (r + 8) * 2 + 2048 * nj
        tiles = -(-tokens // TOKENS)
        chunks = -(-out // chunk)
        resident = max(1, 232448 // (shared + 1024))
        want = int(os.environ.get("SPLITS", max(1, round(SMS * resident / tiles))))
        per_split = -(-chunks // min(want, chunks))
        splits = -(-chunks // per_split)
        return nj, shared, tiles, chunks, per_split, splits

    def buffers(self, dy, b):
        tokens, out = dy.shape
        r = b.shape[1]
        plan = self.plan(tokens, out, r)
        splits, tiles = plan[5], plan[2]
        f32 = dict(device="cuda", dtype=torch.float32)
        return plan, (torch.empty(splits, tokens, r, **f32), torch.empty(tiles, out, r, **f32),
                      torch.empty(tokens, r, device="cuda", dtype=dy.dtype), torch.empty(out, r, device="cuda", dtype=dy.dtype))

    def run(self, dy, b, h, scale, bufs=None, parts=("dy", "sum")):
        """Both launches (or those `parts` name) into `bufs` (fresh ones when None); returns dh, dB."""
        tokens, out = dy.shape
        r = b.shape[1]
        plan, bufs = self.buffers(dy, b) if bufs is None else bufs
        nj, shared, tiles, chunks, per_split, splits = plan
        part_dh, part_db, dh, db = bufs
        f, fsum = self.functions(nj)
        f.max_dynamic_shared_size_bytes = shared
        u = np.uint32
        c = lambda t: cp.asarray(t.view(torch.int16) if t.dtype != torch.float32 else t)
        with cp.cuda.Stream.from_external(torch.cuda.current_stream()):
            if "dy" in parts:
                f((splits, tiles), (256,), (c(dy), c(b), c(h), c(part_dh), c(part_db), u(tokens), u(out), u(chunks), u(per_split)), shared_mem=shared)
            if "sum" in parts:
                total = (tokens * r + out * r) // 4
                fsum((-(-total // 256),), (256,), (c(part_dh), c(part_db), c(dh), c(db), u(tokens * r), u(out * r), u(splits), u(tiles), np.float32(scale)))
        return dh, db


def main():
    paths = sys.argv[1:] or [os.path.join(SRC, "lora", "dy.cu")]
    variants = [Variant(p) for p in paths]
    for tokens, out, r in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(tokens + out + r)
        dy = torch.randn(tokens, out, device="cuda", generator=g).to(DTYPE)
        b = (torch.randn(out, r, device="cuda", generator=g) * 0.1).to(DTYPE)
        h = torch.randn(tokens, r, device="cuda", generator=g).to(DTYPE)
        s = 2.0
        ref_dh = s * dy.double() @ b.double()
        ref_db = s * dy.double().T @ h.double()
        torch_dh, torch_db = s * (dy @ b), s * (dy.T @ h)
        err = lambda x, ref: ((x.double() - ref).abs().max() / ref.abs().max()).item()
        # The peer's products without the scale (cuBLAS would take it as alpha).
        peer = gpu_seconds(lambda: (torch.mm(dy, b), torch.mm(dy.T, h)), calls=100)
        print(f"lora-dy {KIND} tokens {tokens} out {out} r {r}: torch's two products {peer * 1e6:.1f} us, rel err dh {err(torch_dh, ref_dh):.2e} dB {err(torch_db, ref_db):.2e}", flush=True)
        for v in variants:
            bufs = v.buffers(dy, b)
            for buf in bufs[1]:
                buf.fill_(float("nan"))
            dh, db = v.run(dy, b, h, s, bufs)
            torch.cuda.synchronize()
            e_dh, e_db = err(dh, ref_dh), err(db, ref_db)
            ok = e_dh <= 2 * err(torch_dh, ref_dh) + 8e-3 and e_db <= 2 * err(torch_db, ref_db) + 8e-3
            bufs = v.buffers(dy, b)
            t = gpu_seconds(lambda: v.run(dy, b, h, s, bufs), calls=100)
            t_dy = gpu_seconds(lambda: v.run(dy, b, h, s, bufs, ("dy",)), calls=100)
            t_sum = gpu_seconds(lambda: v.run(dy, b, h, s, bufs, ("sum",)), calls=100)
            plan = bufs[0]
            gbs = dy.numel() * 2 / t / 1e9
            print(f"  {v.name}: {t * 1e6:.1f} us ({peer / t:.2f}x torch, dy at {gbs:.0f} GB/s; dy kernel alone {t_dy * 1e6:.1f}, sum alone {t_sum * 1e6:.1f}), splits {plan[5]} tiles {plan[2]} shared {plan[1]}, rel err dh {e_dh:.2e} dB {e_db:.2e} {'ok' if ok else 'FAILED'}", flush=True)
        del dy, b, h
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
