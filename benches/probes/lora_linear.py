"""kiln's fused LoRA GEMM on Hopper (`kernels/src/lora/linear.cu`: the base product and the rank-r
update in one warpgroup-MMA GEMM) and edited copies of it, outside kiln's build: each `.cu` is built
by nvcc for sm_90a after the Hopper header, the float wrappers and `cuda_out.cuh`, checked against
an f64 product (the error rule: within twice the error of torch's two products in the same dtype,
plus one rounding; the outputs poisoned with NaN first), and timed like `benches/peers/gemm.py`'s `gpu_seconds` next to torch's base
product alone and its base product plus `addmm` of the update (the composed path kiln's cuBLASLt
takes).

A shape's layout names how W and R are stored: `n` N-major (`[k, n]`, `[r, n]`), `k` K-major (`[n, k]`,
`[n, r]`): kiln's forward `y = x · W₀ + (s · h) · Bᵀ + bias` is `nk` (Burn's `[in, out]` weight, PEFT's
B `[out, r]`), its input gradient `dx = dy · W₀ᵀ + dh · A` is `kn`; a trailing `c` adds a residual
`[m, n]` (a gradient registered before), which torch's composed path adds after its products.

Usage on the GPU machine, from the repository root:
    python3 benches/probes/lora_linear.py [variant.cu ...]   (default: kernels/src/lora/linear.cu)
Environment: LINEAR_SHAPES (`layout:m`x`n`x`k`x`r` list, layout kk, kn, nk or nn (+ `c`), r 0 for the plain GEMM), KINDS (1 f16,
2 bf16; default both on the first three shapes, bf16 after), DEFINES (`;`-separated lines before
the sources)."""
import os, re, sys
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
sys.path.insert(0, HERE)
from gemm import gpu_seconds  # noqa: E402  (CUDA events behind torch.cuda._sleep)
from ternary_gemm import build  # noqa: E402
from ternary_grad import tensor_map, bits  # noqa: E402
import cupy as cp  # noqa: E402

SRC = os.path.join(HERE, "..", "..", "kernels", "src")
DEFAULT = ("nk:300x1000x2560x16,knc:300x1000x2560x16,kk:17x64x192x8,nnc:777x4104x1088x64,nk:777x4104x1088x40,knc:64x136x72x24,kkc:300x520x4096x16,"
           "nk:4096x4096x4096x0,nk:4096x4096x4096x16,kn:4096x4096x4096x16,knc:4096x4096x4096x16,nk:4096x11008x4096x16,kn:4096x4096x11008x16,knc:4096x4096x11008x16")
SHAPES = [(s.split(":")[0], tuple(int(v) for v in s.split(":")[1].split("x"))) for s in os.environ.get("LINEAR_SHAPES", DEFAULT).split(",")]
DTYPES = {1: torch.float16, 2: torch.bfloat16}
FEATS = 128
SMS = torch.cuda.get_device_properties(0).multi_processor_count


class Variant:
    def __init__(self, path):
        self.name = os.path.basename(path)
        text = open(path).read()
        maps = ("const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map, const __grid_constant__ TensorMap l_map, const __grid_constant__ TensorMap r_map,\n"
                "    const __grid_constant__ TensorMap out_map, const __grid_constant__ TensorMap c_map,")
        sig = "const __grid_constant__ LinearParams p) {"
        assert maps in text and sig in text
        text = text.replace(maps, "const TensorMap* __restrict__ maps,")
        self.src = text.replace(sig, "u32 p_m, u32 p_n, u32 p_k, u32 p_bias) {\n    const LinearParams p{p_m, p_n, p_k, p_bias};\n"
                                "    const TensorMap &x_map = maps[0], &w_map = maps[1], &l_map = maps[2], &r_map = maps[3], &out_map = maps[4], &c_map = maps[5];")
        self.cache = {}
        define = lambda name: int(m.group(1)) if (m := re.search(rf"#define {name} (\d+)", text)) else 1
        # Cubes a cluster (each copying 1 / CLUSTER of x's rows) and output store rounds.
        self.cluster, self.rounds = define("CLUSTER"), define("ROUNDS")

    def function(self, kind, mn, steps, residual):
        key = (kind, mn, steps, residual)
        w_mn, r_mn = mn
        if key not in self.cache:
            wgmma_type = "f16" if kind == 1 else "bf16"
            defines = f"#define KILN_OUT_KIND {kind}\n#define KILN_WGMMA_TYPE \"{wgmma_type}\"\n#define KILN_W_MN {w_mn}\n#define KILN_R_MN {r_mn}\n#define KILN_UPDATE_STEPS {steps}\n#define KILN_RESIDUAL {residual}\n" + os.environ.get("DEFINES", "").replace(";", "\n") + "\n"
            headers = ("hopper/common.cuh", "hopper/wgmma.cuh", "cuda_out.cuh")
            self.cache[key] = build(defines, headers, self.src, f"{self.name}_{kind}_{w_mn}{r_mn}_{steps}_{residual}".replace(".", "_"), "kiln_lora_linear")
        return self.cache[key]

    def launch(self, kind, mn, steps, residual, m, n, k, has_bias, bufs, stream):
        fn, shared, threads, toks = self.function(kind, mn, steps, residual)
        c = self.cluster
        cubes = min(-(-m // toks) * -(-n // (c * FEATS)), SMS // c) * c
        u = cp.uint32
        fn((cubes,), (threads,), bufs + (u(m), u(n), u(k), u(has_bias)), shared_mem=shared, stream=stream)


def main():
    paths = sys.argv[1:] or [os.path.join(SRC, "lora", "linear.cu")]
    variants = [Variant(p) for p in paths]
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for index, (layout, (m, n, k, r)) in enumerate(SHAPES):
        mn = tuple(int(c == "n") for c in layout[:2])
        residual = int(layout.endswith("c"))
        steps = -(-r // 16)
        line = f"{layout} m{m} n{n} k{k} r{r}:"
        flops = 2 * m * n * k
        kinds = [int(v) for v in os.environ["KINDS"].split(",")] if "KINDS" in os.environ else [1, 2] if index < 3 else [2]
        for kind in kinds:
            dtype = DTYPES[kind]
            x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
            w = (torch.randn(k, n, device="cuda", generator=gen) if mn[0] else torch.randn(n, k, device="cuda", generator=gen)).to(dtype) * 0.02
            rr = max(r, 8)
            l = torch.randn(m, rr, device="cuda", dtype=dtype, generator=gen)
            right = (torch.randn(rr, n, device="cuda", generator=gen) if mn[1] else torch.randn(n, rr, device="cuda", generator=gen)).to(dtype) * 0.05
            has_bias = int(r % 16 != 0)
            c = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen) if residual else None
            bias = torch.randn(n, device="cuda", dtype=dtype, generator=gen) if has_bias else torch.zeros(1, device="cuda", dtype=dtype)
            wt = w if mn[0] else w.T
            rt = right if mn[1] else right.T
            ref = x.double() @ wt.double()
            if r:
                ref += l.double() @ rt.double()
            if has_bias:
                ref += bias.double()
            if residual:
                ref += c.double()

            def composed():
                y = x @ wt
                if r:
                    y.addmm_(l, rt)
                if residual:
                    y += c
                return y
            torch_out = composed() + (bias if has_bias else 0)
            mag = ref.abs().max().item()
            torch_err = (torch_out.double() - ref).abs().max().item() / mag
            line += f" | kind {kind} torch err {torch_err:.2e}"
            for v in variants:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                # W's box: 128 rows of 64 (K-major) or 64 by 64 (N-major); l and R as x and W.
                w_box, r_box = (64 if c else FEATS for c in mn)
                x_box, out_box = 256 // v.cluster, 256 // v.rounds
                c_or_out = c if residual else out
                maps = torch.cat([tensor_map(x, x_box), tensor_map(w, w_box), tensor_map(l, x_box), tensor_map(right, r_box), tensor_map(out, out_box), tensor_map(c_or_out, out_box)])
                bufs = (cp.asarray(maps), bits(x), bits(w), bits(l), bits(right), bits(out), bits(c_or_out), bits(bias))
                with stream:
                    v.launch(kind, mn, steps, residual, m, n, k, has_bias, bufs, stream)
                stream.synchronize()
                err = (out.double() - ref).abs().max().item() / mag
                eps = 2.0 ** (-11 if kind == 1 else -8)
                ok = bool(torch.isfinite(out).all()) and err <= 2 * torch_err + eps
                line += f" | {v.name} err {err:.2e} {'ok' if ok else 'FAILED'}"
                if m >= 512 and kind == kinds[-1]:
                    with stream:
                        t = gpu_seconds(lambda: v.launch(kind, mn, steps, residual, m, n, k, has_bias, bufs, stream), calls=30)
                    line += f" {t * 1e3:.4f} ms {flops / t / 1e12:4.0f} TF/s"
                del out
            if m >= 512 and kind == kinds[-1]:
                tb = gpu_seconds(lambda: x @ wt, calls=30)
                tc = gpu_seconds(composed, calls=30)
                line += f" | torch base {tb * 1e3:.4f} ms ({flops / tb / 1e12:.0f} TF/s), base + addmm {tc * 1e3:.4f} ms"
            del x, w, l, right, ref, torch_out, c
        print(line, flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
