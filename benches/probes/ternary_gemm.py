"""The W2A8 GEMM on Hopper's integer wgmma (`kiln_ternary_gemm` in `kernels/src/ternary/gemm.cu`)
and edited copies of it, without a Rust build: each `.cu` is built by nvcc for sm_90a after the
Hopper header, the integer wrappers and `cuda_out.cuh` (ptxas' registers, spills and wgmma
warnings printed), checked bit-exactly against torch (f64 integer sums, then the same f32
division and rounding) on random codes and scales over 2^-10 … 2^10, and timed like
`benches/peers/gemm.py`'s `gpu_seconds` next to torch's bf16 GEMM and `torch._int_mm`
(cuBLASLt's int8 GEMM) in the same process, at every shape but the first. A source that
bulk-copies its activations takes them tiled (`ActCodes::Tiled`), the others row-major.

Usage on the GPU machine, from the repository root:
    python3 benches/probes/ternary_gemm.py [variant.cu ...]   (default: the committed kernel)
Environment: SHAPES (`m`x`n`x`k` list), KINDS (output kinds checked at every shape, 0 f32, 1 f16,
2 bf16; default all three on the first shape, bf16 after; timings are of the last kind), SPLITS
(KILN_SPLITS values, each a variant of every source: cubes a tile splitting k over a cluster;
default 1), CUBES (the grid of a stream-K source without a cluster split: `tiles` for one tile a
cube, a number, or by default `wgmma::grid`'s rule on 132 SMs)."""
import os, subprocess, sys, re
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from gemm import gpu_seconds  # noqa: E402  (CUDA events behind torch.cuda._sleep)
import cupy as cp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "kernels", "src")
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get(
    "SHAPES", "300x1000x2600,512x28672x8192,2048x28672x8192,8192x28672x8192,512x11008x4096,2048x11008x4096,8192x11008x4096,2048x4096x11008").split(",")]
DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}
FEATS = 128


def build(defines, headers, source, tag, entry):
    """nvcc-builds `source` for sm_90a after `defines` and the kiln `headers` (paths under
    `kernels/src`), as kiln places them, with a `shared_bytes` entry added; prints ptxas' registers,
    spills and wgmma warnings. Returns the kernel `entry` (its dynamic shared memory raised to the
    source's KILN_SHARED_BYTES), that size, the source's THREADS and its TOKS (activation rows
    a tile)."""
    head = [open(os.path.join(SRC, *h.split("/"))).read() for h in headers]
    tail = '\nextern "C" __global__ void shared_bytes(u32* o) { o[0] = KILN_SHARED_BYTES; o[1] = THREADS; o[2] = TOKS; }\n'
    cu = f"/tmp/probe_{tag}.cu"
    open(cu, "w").write(defines + "\n".join(head + [source, tail]))
    cubin = cu.replace(".cu", ".cubin")
    r = subprocess.run(["nvcc", "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", cu, "-o", cubin], capture_output=True, text=True)
    info = [l.strip() for l in (r.stdout + r.stderr).splitlines() if any(w in l.lower() for w in ("registers", "spill", "error", "warn", "wgmma"))]
    print(f"build {tag}: rc {r.returncode}; " + " | ".join(info[-6:]), flush=True)
    if r.returncode != 0:
        print(r.stderr[-4000:])
        sys.exit(1)
    mod = cp.RawModule(path=cubin)
    fn = mod.get_function(entry)
    sb = cp.zeros(3, dtype=cp.uint32)
    mod.get_function("shared_bytes")((1,), (1,), (sb,))
    shared, threads, toks = (int(v) for v in sb.get())
    fn.max_dynamic_shared_size_bytes = shared
    return fn, shared, threads, toks


class Variant:
    def __init__(self, path, splits):
        self.name = os.path.basename(path) + (f":S{splits}" if splits > 1 else "")
        self.splits = splits
        text = open(path).read()
        sig = "const __grid_constant__ GemmParams p) {"
        assert sig in text
        self.src = text.replace(sig, "u32 p_m, u32 p_n, u32 p_rw, u32 p_group) {\n    const GemmParams p{p_m, p_n, p_rw, p_group};")
        # A variant that bulk-copies activations takes them block-major and pre-swizzled
        # (`[k / 128][m][128]`, the 16-byte chunk c of row r at c ^ (r % 8)).
        self.tiled = "cp.async.bulk" in text
        # A stream-K source takes its sync buffer (zero) and the helpers' slots after `out`.
        self.stream_k = "u32* __restrict__ sync" in text
        self.cache, self.buffers = {}, {}

    def function(self, kind):
        if kind not in self.cache:
            headers = ("hopper/common.cuh", "hopper/wgmma_int.cuh", "cuda_out.cuh")
            defines = f"#define KILN_OUT_KIND {kind}\n#define KILN_SPLITS {self.splits}\n"
            self.cache[kind] = build(defines, headers, self.src, f"{self.name.replace(':', '_')}_{kind}", "kiln_ternary_gemm")
        return self.cache[kind]

    def launch(self, kind, m, n, row_words, group, bufs, stream):
        fn, shared, threads, toks = self.function(kind)
        tiles = -(-m // toks) * -(-n // FEATS)
        cubes = tiles * self.splits
        if self.stream_k:
            if self.splits == 1:
                cubes = stream_k_cubes(tiles)
            if cubes not in self.buffers:  # a launch leaves the sync buffer zero for the next
                self.buffers[cubes] = (cp.zeros(1024, dtype=cp.uint32), cp.empty(cubes * FEATS * toks, dtype=cp.uint32))
            bufs = bufs + self.buffers[cubes]
        u = cp.uint32
        fn((cubes,), (threads,), bufs + (u(m), u(n), u(row_words), u(group)), shared_mem=shared, stream=stream)


def stream_k_cubes(tiles, sms=132):
    """`wgmma::grid` without a cluster split: one cube an SM for more tiles than SMs (stream-K),
    else one a tile; or `CUBES` (`tiles`, or a number)."""
    want = os.environ.get("CUBES")
    if want == "tiles":
        return tiles
    if want:
        return int(want)
    return sms if tiles > sms else tiles


def pack(codes):
    """[n, kp] codes 0..2 → [n, kp / 16] words: element i of a word at bit 8 (i % 4) + 2 (i / 4)."""
    n, kp = codes.shape
    c = codes.to(torch.int64).reshape(n, kp // 16, 4, 4)  # word, i / 4, i % 4
    shifts = (8 * torch.arange(4, device=codes.device)[None, None, None, :] + 2 * torch.arange(4, device=codes.device)[None, None, :, None])
    words = (c << shifts).sum(dim=(2, 3))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def tiled(xq):
    m, kp = xq.shape
    kb = -(-kp // 128)
    x = torch.zeros(m, kb * 128, dtype=xq.dtype, device=xq.device)
    x[:, :kp] = xq
    x = x.reshape(m, kb, 8, 16)
    chunks = torch.arange(8, device=xq.device)[None, :] ^ (torch.arange(m, device=xq.device) % 8)[:, None]  # [m, 8]: source chunk of slot
    x = torch.gather(x, 2, chunks[:, None, :, None].expand(m, kb, 8, 16))
    return x.permute(1, 0, 2, 3).contiguous()


def ptr(t):
    return cp.asarray(t) if t.dtype not in (torch.bfloat16,) else cp.asarray(t.view(torch.int16))


def main():
    paths = sys.argv[1:] or [os.path.join(SRC, "ternary", "gemm.cu")]
    splits = [int(v) for v in os.environ.get("SPLITS", "1").split(",")]
    variants = [Variant(p, s) for p in paths for s in splits]
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for index, (m, n, k) in enumerate(SHAPES):
        kp = -(-k // 64) * 64
        group = n if index else 7
        wc = torch.randint(0, 3, (n, kp), device="cuda", dtype=torch.int8, generator=gen)
        wc[:, k:] = 1
        words = pack(wc)
        xq = torch.randint(-128, 128, (m, kp), device="cuda", dtype=torch.int8, generator=gen)
        xq[:, k:] = 0
        sums = xq.to(torch.float32).sum(1)
        # scales over 2^-10 … 2^10, so the divisions see many exponents and mantissas
        sx = torch.exp2(torch.rand(m, device="cuda", generator=gen) * 20 - 10)
        sw = torch.exp2(torch.rand(-(-n // group), device="cuda", generator=gen) * 20 - 10)
        acc = (xq.double() @ (wc.double() - 1).t()).float()
        ref32 = acc / (sx[:, None] * sw.repeat_interleave(group)[None, :n])
        del acc
        line = f"m{m} n{n} k{k}:"
        ops = 2 * m * n * k
        kinds = [int(v) for v in os.environ["KINDS"].split(",")] if "KINDS" in os.environ else [0, 1, 2] if index == 0 else [2]
        for v in variants:
            for kind in kinds:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=DTYPES[kind])
                bufs = (cp.asarray(tiled(xq) if v.tiled else xq), cp.asarray(sx), cp.asarray(sums), cp.asarray(words), cp.asarray(sw), ptr(out))
                with stream:
                    v.launch(kind, m, n, kp // 16, group, bufs, stream)
                stream.synchronize()
                ref = ref32.to(DTYPES[kind])
                bad = int((out.view(torch.int32 if kind == 0 else torch.int16) != ref.view(torch.int32 if kind == 0 else torch.int16)).sum())
                line += f" | {v.name} kind {kind} {'exact' if bad == 0 else f'{bad} WRONG'}"
            if index > 0:
                with stream:
                    t = gpu_seconds(lambda: v.launch(kinds[-1], m, n, kp // 16, group, bufs, stream), calls=40)
                line += f" {t * 1e3:.4f} ms {ops / t / 1e12:5.0f} TOP/s"
        del ref32, out
        if index > 0:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            tb = gpu_seconds(lambda: x @ w.t(), calls=40)
            del x, w
            w8 = (wc[:, :k] - 1).contiguous()
            x8 = xq[:, :k].contiguous()
            line += f" | torch bf16 {tb * 1e3:.4f} ms ({ops / tb / 1e12:.0f} TF/s)"
            if k % 8 == 0 and n % 8 == 0:  # `_int_mm`'s constraint
                ti = gpu_seconds(lambda: torch._int_mm(x8, w8.t()), calls=40)
                line += f" | _int_mm {ti * 1e3:.4f} ms ({ops / ti / 1e12:.0f} TOP/s)"
            del w8, x8
        print(line, flush=True)
        del wc, words, xq
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
