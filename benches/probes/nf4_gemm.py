"""kiln's 4-bit GEMM on Hopper's warpgroup MMA (`kernels/src/nf4/gemm.cu`, the weight's A operand
made in registers) and edited copies of it, outside kiln's build: each `.cu` is built by nvcc for
sm_90a after the Hopper header, the float wrappers and `cuda_out.cuh` (ptxas' registers, spills and
wgmma warnings printed), checked against an f64 product of the weight dequantized as bitsandbytes
does it (the error rule: within twice the error of cuBLAS multiplying that weight, in the same
dtype, plus one rounding), and timed like `benches/peers/gemm.py`'s `gpu_seconds` next to torch's
GEMM on the dequantized weight (the two-pass path without its dequantization). The thirty-seventh
session's probe with value tiles through shared memory is `benches/probes/nf4_gemm.cu` at
4f4e2a6.

Usage on the GPU machine, from the repository root:
    python3 benches/probes/nf4_gemm.py [variant.cu ...]   (default: kernels/src/nf4/gemm.cu)
Environment: SHAPES (`m`x`n`x`k` list: x `[m, k]`, weight `[n, k]`), KINDS (1 f16, 2 bf16; default
both on the first two shapes, bf16 after; timings are of the last kind), NESTED (0 or 1; default
the first shape plain, the others double-quantized), BLOCK (default 64), SPLITS (KILN_SPLITS
values, each a variant of every source; default 1), DEFINES (`;`-separated lines placed before
the sources, e.g. `#define STAGES 5` for a source that leaves its tiling to `#ifndef`). A source's
TOKS sets its activation tile."""
import os, sys
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
sys.path.insert(0, HERE)
from gemm import gpu_seconds  # noqa: E402  (CUDA events behind torch.cuda._sleep)
from ternary_gemm import build  # noqa: E402
from ternary_grad import tensor_map, bits  # noqa: E402
import cupy as cp  # noqa: E402

SRC = os.path.join(HERE, "..", "..", "kernels", "src")
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get(
    "SHAPES", "300x1000x2560,17x64x192,512x4096x4096,512x11008x4096,512x4096x11008,2048x4096x4096,2048x11008x4096,2048x4096x11008,8192x4096x4096,8192x11008x4096").split(",")]
DTYPES = {1: torch.float16, 2: torch.bfloat16}
FEATS = 128
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230850219727, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


class Variant:
    def __init__(self, path, splits):
        self.name = os.path.basename(path) + (f":S{splits}" if splits > 1 else "")
        self.splits = splits
        text = open(path).read()
        sig = "const __grid_constant__ GemmParams p) {"
        assert sig in text
        text = text.replace("const __grid_constant__ TensorMap x_map,", "const TensorMap* __restrict__ x_map_ptr,")
        self.src = text.replace(sig, "u32 p_m, u32 p_n, u32 p_k, u32 p_shift) {\n    const GemmParams p{p_m, p_n, p_k, p_shift};\n    const TensorMap& x_map = *x_map_ptr;")
        self.cache = {}

    def function(self, kind, nested):
        if (kind, nested) not in self.cache:
            wgmma_type = "f16" if kind == 1 else "bf16"
            defines = f"#define KILN_OUT_KIND {kind}\n#define KILN_WGMMA_TYPE \"{wgmma_type}\"\n#define KILN_NESTED {nested}\n#define KILN_SPLITS {self.splits}\n" + os.environ.get("DEFINES", "").replace(";", "\n") + "\n"
            headers = ("hopper/common.cuh", "hopper/wgmma.cuh", "cuda_out.cuh")
            self.cache[(kind, nested)] = build(defines, headers, self.src, f"{self.name.replace(':', '_')}_{kind}_{nested}", "kiln_nf4_gemm")
        return self.cache[(kind, nested)]

    def toks(self, kind, nested):
        """The source's activation rows a tile (its TOKS)."""
        return self.function(kind, nested)[3]

    def launch(self, kind, nested, m, n, k, block, bufs, stream):
        fn, shared, threads, toks = self.function(kind, nested)
        cubes = -(-m // toks) * -(-n // FEATS) * self.splits
        u = cp.uint32
        fn((cubes,), (threads,), bufs + (u(m), u(n), u(k), u(block.bit_length() - 1)), shared_mem=shared, stream=stream)


def weight(n, k, block, nested, gen):
    """Random packed codes and scales, and the weight bitsandbytes dequantizes from them (f32)."""
    blocks = n * k // block
    packed = torch.randint(0, 256, (n * k // 2,), device="cuda", dtype=torch.uint8, generator=gen)
    # absmax of N(0, σ) weights in blocks of 64: about 2.5 σ; σ over 2^-6 … 2^0
    if nested:
        q = torch.randint(0, 256, (-(-blocks // 4) * 4,), device="cuda", dtype=torch.uint8, generator=gen)
        code2 = torch.sort(torch.rand(256, device="cuda", generator=gen) * 2 - 1).values
        code2[-1] = 1.0
        nabs = torch.exp2(torch.rand(-(-blocks // 256), device="cuda", generator=gen) * 6 - 6)
        offset = torch.tensor([0.03125], device="cuda")
        scale = (code2[q[:blocks].long()] * nabs.repeat_interleave(256)[:blocks]) + offset
        parts = (nabs, q.view(torch.int32), code2, offset)
    else:
        scale = torch.exp2(torch.rand(blocks, device="cuda", generator=gen) * 6 - 5)
        parts = (scale, scale, scale, scale)
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1).long()
    book = torch.tensor(NF4, device="cuda")
    w = (book[codes] * scale.repeat_interleave(block)).reshape(n, k)
    return packed, parts, book, w


def main():
    paths = sys.argv[1:] or [os.path.join(SRC, "nf4", "gemm.cu")]
    variants = [Variant(p, int(s)) for p in paths for s in os.environ.get("SPLITS", "1").split(",")]
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(0)
    block = int(os.environ.get("BLOCK", "64"))
    for index, (m, n, k) in enumerate(SHAPES):
        nested = int(os.environ.get("NESTED", "0" if index == 0 else "1"))
        packed, parts, book, w32 = weight(n, k, block, nested, gen)
        line = f"m{m} n{n} k{k} nested {nested}:"
        flops = 2 * m * n * k
        kinds = [int(v) for v in os.environ["KINDS"].split(",")] if "KINDS" in os.environ else [1, 2] if index < 2 else [2]
        for kind in kinds:
            dtype = DTYPES[kind]
            x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
            w = w32.to(dtype)
            ref = x.double() @ w.double().T
            torch_out = x @ w.T
            scale = ref.abs().max().item()
            torch_err = (torch_out.double() - ref).abs().max().item() / scale
            line += f" | kind {kind} cuBLAS err {torch_err:.2e}"
            for v in variants:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                toks = v.toks(kind, nested)
                x_map = tensor_map(x, toks)
                bufs = (cp.asarray(x_map), bits(x), cp.asarray(packed), cp.asarray(book)) + tuple(cp.asarray(t) for t in parts) + (bits(out),)
                with stream:
                    v.launch(kind, nested, m, n, k, block, bufs, stream)
                stream.synchronize()
                err = (out.double() - ref).abs().max().item() / scale
                eps = 2.0 ** (-11 if kind == 1 else -8)
                ok = bool(torch.isfinite(out).all()) and err <= 2 * torch_err + eps
                line += f" | {v.name} err {err:.2e} {'ok' if ok else 'FAILED'}"
                if m >= 512 and kind == kinds[-1]:
                    with stream:
                        t = gpu_seconds(lambda: v.launch(kind, nested, m, n, k, block, bufs, stream), calls=40)
                    line += f" {t * 1e3:.4f} ms {flops / t / 1e12:4.0f} TF/s"
                del out
            if m >= 512 and kind == kinds[-1]:
                tb = gpu_seconds(lambda: x @ w.T, calls=40)
                line += f" | torch on the dequantized weight {tb * 1e3:.4f} ms ({flops / tb / 1e12:.0f} TF/s)"
            del x, w, ref, torch_out
        print(line, flush=True)
        del packed, parts, w32
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
