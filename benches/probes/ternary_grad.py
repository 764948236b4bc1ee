"""The ternary input gradient on Hopper's warpgroup MMA (`kiln_ternary_input_grad` in
`kernels/src/ternary/grad.cu`) and edited copies of it, without a Rust build: each `.cu` is built
by nvcc for sm_90a after the Hopper header, the float wrappers and `cuda_out.cuh` (ptxas'
registers, spills and wgmma warnings printed), checked against an f64 product of the same
dequantized weight (the error rule: within twice the error of cuBLAS multiplying that weight, in
the same dtype, plus one rounding), and timed like `benches/peers/gemm.py`'s `gpu_seconds` next to
torch's GEMM on the dequantized weight (the path the kernel replaces, without its dequantization).

Usage on the GPU machine, from the repository root:
    python3 benches/probes/ternary_grad.py [variant.cu ...]   (default: the committed kernel)
Environment: SHAPES (`m`x`n`x`k` list: dy `[m, n]`, weight `[n, k]`), KINDS (1 f16, 2 bf16;
default both on the first two shapes, bf16 after; timings are of the last kind), TOKS (gradient
rows a cube takes, 128 or 256; default kiln's choice), SPLITS (KILN_SPLITS values, each a variant
of every source: cubes a tile splitting the reduction; default 1)."""
import ctypes, os, sys
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
sys.path.insert(0, HERE)
from gemm import gpu_seconds  # noqa: E402  (CUDA events behind torch.cuda._sleep)
from ternary_gemm import build, pack  # noqa: E402
import cupy as cp  # noqa: E402

SRC = os.path.join(HERE, "..", "..", "kernels", "src")
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get(
    "SHAPES", "300x1000x2600,17x64x200,4096x11008x4096,4096x4096x11008,2048x28672x8192,8192x28672x8192,512x11008x4096").split(",")]
DTYPES = {1: torch.float16, 2: torch.bfloat16}
COLS = 128


def tokens(m, k):
    """Gradient rows a cube takes, as kiln chooses them (`wgmma::grad_tokens`): 128 for at most 128
    rows, else 256 (kiln splits the reduction where tiles are few; here SPLITS does)."""
    if "TOKS" in os.environ:
        return int(os.environ["TOKS"])
    return 128 if m <= 128 else 256


class Variant:
    def __init__(self, path, splits):
        self.name = os.path.basename(path) + (f":S{splits}" if splits > 1 else "")
        self.splits = splits
        text = open(path).read()
        sig = "const __grid_constant__ GradParams p) {"
        assert sig in text
        # The tensor map comes from global memory here (cupy passes no 128-byte struct by value).
        text = text.replace("const __grid_constant__ TensorMap dy_map,", "const TensorMap* __restrict__ dy_map_ptr,")
        self.src = text.replace(sig, "u32 p_m, u32 p_n, u32 p_k, u32 p_rw, u32 p_group, u32 p_mlo, u32 p_mhi) {\n    const GradParams p{p_m, p_n, p_k, p_rw, p_group, p_mlo, p_mhi};\n    const TensorMap& dy_map = *dy_map_ptr;")
        self.cache = {}

    def function(self, kind, toks):
        if (kind, toks) not in self.cache:
            wgmma_type = "f16" if kind == 1 else "bf16"
            defines = f"#define KILN_OUT_KIND {kind}\n#define KILN_WGMMA_TYPE \"{wgmma_type}\"\n#define KILN_TOKS {toks}\n#define KILN_SPLITS {self.splits}\n"
            headers = ("hopper/common.cuh", "hopper/wgmma.cuh", "cuda_out.cuh")
            self.cache[(kind, toks)] = build(defines, headers, self.src, f"{self.name.replace(':', '_')}_{kind}_{toks}", "kiln_ternary_input_grad")
        return self.cache[(kind, toks)]

    def launch(self, kind, m, n, k, row_words, group, bufs, stream):
        toks = tokens(m, k)
        fn, shared, threads, _ = self.function(kind, toks)
        cubes = -(-m // toks) * -(-k // COLS) * self.splits
        u = cp.uint32
        magic = -(-(1 << 64) // group) if group > 1 else 0  # ⌈2^64 / group⌉, as kiln computes it
        fn((cubes,), (threads,), bufs + (u(m), u(n), u(k), u(row_words), u(group), u(magic & 0xFFFFFFFF), u(magic >> 32)), shared_mem=shared, stream=stream)


def bits(t):
    return cp.asarray(t.view(torch.int16))


CUDA = ctypes.CDLL("libcuda.so.1")


def tensor_map(t, box_rows):
    """The kernel's `dy_map` for a dense `[rows, cols]` f16/bf16 tensor, as kiln asks CubeCL to encode
    it: `box_rows` × 64 boxes, 128-byte swizzle, 256-byte L2 promotion, zeros out of bounds; in a device buffer."""
    rows, cols = t.shape
    out = (ctypes.c_uint64 * 16)()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dtype = 6 if t.dtype == torch.float16 else 9  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
    r = CUDA.cuTensorMapEncodeTiled(out, ctypes.c_int(dtype), u32(2), ctypes.c_void_p(t.data_ptr()), (u64 * 2)(cols, rows), (u64 * 1)(cols * 2),
                                    (u32 * 2)(64, box_rows), (u32 * 2)(1, 1), ctypes.c_int(0), ctypes.c_int(3), ctypes.c_int(3), ctypes.c_int(0))
    assert r == 0, f"cuTensorMapEncodeTiled: {r}"
    return torch.tensor(list(bytes(out)), dtype=torch.uint8, device=t.device)


def main():
    paths = sys.argv[1:] or [os.path.join(SRC, "ternary", "grad.cu")]
    variants = [Variant(p, int(s)) for p in paths for s in os.environ.get("SPLITS", "1").split(",")]
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for index, (m, n, k) in enumerate(SHAPES):
        kp = -(-k // 64) * 64
        group = (7, 1)[index] if index < 2 else n
        wc = torch.randint(0, 3, (n, kp), device="cuda", dtype=torch.int8, generator=gen)
        wc[:, k:] = 1
        words = pack(wc)
        # scales s = 1 / mean|W| of trained weights are ~10…1000; here 2^0 … 2^12
        sw = torch.exp2(torch.rand(-(-n // group), device="cuda", generator=gen) * 12)
        line = f"m{m} n{n} k{k}:"
        flops = 2 * m * n * k
        kinds = [int(v) for v in os.environ["KINDS"].split(",")] if "KINDS" in os.environ else [1, 2] if index < 2 else [2]
        for kind in kinds:
            dtype = DTYPES[kind]
            dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
            # the dequantized weight: (c − 1) · (1 / s) in f32, rounded once to the dtype
            w = ((wc[:, :k].float() - 1) * (1.0 / sw).repeat_interleave(group)[:n, None]).to(dtype)
            ref = dy.double() @ w.double()
            torch_out = dy @ w
            scale = ref.abs().max().item()
            torch_err = (torch_out.double() - ref).abs().max().item() / scale
            line += f" | kind {kind} cuBLAS err {torch_err:.2e}"
            for v in variants:
                dx = torch.full((m, k), float("nan"), device="cuda", dtype=dtype)
                dy_map = tensor_map(dy, tokens(m, k))
                bufs = (cp.asarray(dy_map), bits(dy), cp.asarray(words), cp.asarray(sw), bits(dx))
                with stream:
                    v.launch(kind, m, n, k, kp // 16, group, bufs, stream)
                stream.synchronize()
                err = (dx.double() - ref).abs().max().item() / scale
                eps = 2.0 ** (-11 if kind == 1 else -8)
                ok = bool(torch.isfinite(dx).all()) and err <= 2 * torch_err + eps
                line += f" | {v.name} err {err:.2e} {'ok' if ok else 'FAILED'}"
                if m >= 512 and kind == kinds[-1]:
                    with stream:
                        t = gpu_seconds(lambda: v.launch(kind, m, n, k, kp // 16, group, bufs, stream), calls=40)
                    line += f" {t * 1e3:.4f} ms {flops / t / 1e12:4.0f} TF/s"
                del dx
            if m >= 512 and kind == kinds[-1]:
                tb = gpu_seconds(lambda: dy @ w, calls=40)
                line += f" | torch on the dequantized weight {tb * 1e3:.4f} ms ({flops / tb / 1e12:.0f} TF/s)"
            del dy, w, ref, torch_out
        print(line, flush=True)
        del wc, words
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
