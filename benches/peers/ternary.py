"""torch peers of kiln's `ternary-bench` mode (benches/gpu_check/ternary.rs), same call:
  * GEMV at BitNet's shapes and two Llama ones, 1 and 8 rows: torch bf16 (`x @ W.T`) and HF
    transformers' own BitNet path (`BitLinear`: unpack the 2-bit weight, quantize the activations
    to int8 per token, bf16 linear, rescale), wall time per call and the GPU's own time (calls
    queued behind `torch.cuda._sleep`, CUDA events);
  * prefill products at M = 512, 2048, 8192 in bf16 and with `torch._int_mm` (i8 x i8 -> i32 on
    the integer tensor cores, the W2A8 product's ceiling without the 2-bit unpacking);
  * a QAT training step's linear (4096 tokens, 4096 -> 11008) in bf16: forward + backward, and
    the memory its forward holds for the backward;
  * BitNet's MLP gating relu(g)^2 * u at [16384, 6912] bf16, eager and torch.compile'd.
Prints lines starting with `peer ternary`."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gemm import gpu_seconds, seconds  # noqa: E402

# (n, k): BitNet's table (weights [n, k]) and Llama's 4096 -> 11008, 8192 -> 28672.
GEMV = [(2560, 2560), (13824, 2560), (2560, 6912), (3200, 10240), (20480, 3200), (11008, 4096), (28672, 8192)]
# `PREFILL=6912x2560,..` (`n`x`k`) and `PREFILL_ROWS=512,2048` pick other products, as kiln's bench takes them.
PREFILL = [tuple(int(v) for v in s.split("x")) for s in os.environ["PREFILL"].split(",")] if "PREFILL" in os.environ else [(11008, 4096), (4096, 11008), (28672, 8192)]
PREFILL_ROWS = [int(v) for v in os.environ.get("PREFILL_ROWS", "512,2048,8192").split(",")]
HBM = 3.35e12
bf = torch.bfloat16


def hf_bitlinear(packed, scale):
    """transformers' BitLinear forward (integrations/bitnet.py), written out: unpack the rows
    (four per byte, row i * n/4 + r at bits 2i of byte row r), int8 activations, bf16 linear."""
    def run(x):
        w = torch.cat([((packed >> (2 * i)) & 3) for i in range(4)], 0).to(bf) - 1
        s = 127 / x.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5)
        q = (x * s).round().clamp(-128, 127)
        return torch.nn.functional.linear(q.to(bf), w) / (s * scale)
    return run


def gemv():
    for n, k in GEMV:
        w = torch.randn(n, k, device="cuda", dtype=bf)
        packed = torch.randint(0, 256, (n // 4, k), device="cuda", dtype=torch.uint8) & 0x55
        hf = hf_bitlinear(packed, 2.0)
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=bf)
            dense = lambda: x @ w.t()
            bitnet = lambda: hf(x)
            bt, bg = seconds(dense, cap=2000), gpu_seconds(dense)
            ht, hg = seconds(bitnet, cap=2000), gpu_seconds(bitnet)
            db = 2 * (n * k + m * (n + k))
            print(f"peer ternary gemv m{m} n{n:<6} k{k:<6} torch bf16: {bt * 1e6:7.1f} us/call, GPU {bg * 1e6:6.1f} us "
                  f"({db / bg / 1e9:5.0f} GB/s, {100 * db / bg / HBM:4.1f}% of HBM) | HF BitLinear: {ht * 1e6:7.1f} us/call, "
                  f"GPU {hg * 1e6:7.1f} us", flush=True)
        del w, packed
        torch.cuda.empty_cache()


def prefill():
    for n, k in PREFILL:
        w = torch.randn(n, k, device="cuda", dtype=bf)
        wi = torch.randint(-1, 2, (n, k), device="cuda", dtype=torch.int8)
        for m in PREFILL_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=bf)
            xi = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
            t = seconds(lambda: x @ w.t(), cap=200)
            ti = seconds(lambda: torch._int_mm(xi, wi.t()), cap=200)
            flops = 2 * m * k * n
            print(f"peer ternary prefill m{m:<5} n{n:<6} k{k:<6} torch bf16 {t * 1e3:8.3f} ms ({flops / t / 1e12:4.0f} TF/s) | "
                  f"torch int8 _int_mm {ti * 1e3:8.3f} ms ({flops / ti / 1e12:4.0f} TOP/s)", flush=True)
        del w, wi
        torch.cuda.empty_cache()


def qat_step():
    m, n, k = 4096, 11008, 4096
    w = torch.randn(n, k, device="cuda", dtype=bf, requires_grad=True)
    x = torch.randn(m, k, device="cuda", dtype=bf, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=bf)
    step = lambda: torch.autograd.grad((x @ w.t() * dy).sum(), [x, w])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = x @ w.t()
    held = torch.cuda.memory_allocated() - before  # the output and what autograd saves for the backward
    del y
    print(f"peer ternary qat memory m{m} n{n} k{k}, held by the bf16 forward for the backward: {held / 1e6:.1f} MB", flush=True)
    t = seconds(step, cap=50)
    print(f"peer ternary qat step m{m} n{n} k{k} bf16 linear fwd+bwd: {t * 1e3:.3f} ms "
          f"({3 * 2 * m * k * n / t / 1e12:.0f} TF/s)", flush=True)


def relu2_glu():
    t, f = 16384, 6912
    g = torch.randn(t, f, device="cuda", dtype=bf, requires_grad=True)
    u = torch.randn(t, f, device="cuda", dtype=bf, requires_grad=True)
    dy = torch.randn(t, f, device="cuda", dtype=bf)
    eager = lambda g, u: torch.relu(g).square() * u
    compiled = torch.compile(eager)
    nbytes = t * f * 2
    for name, fn in (("eager", eager), ("compiled", compiled)):
        with torch.no_grad():
            fwd = seconds(lambda: fn(g, u), cap=200)
        both = seconds(lambda: torch.autograd.grad((fn(g, u) * dy).sum(), [g, u]), cap=200)
        print(f"peer ternary relu2_glu [{t},{f}] bf16 torch {name}: fwd {fwd * 1e6:.1f} us ({100 * 3 * nbytes / fwd / HBM:.0f}% HBM) | "
              f"fwd+bwd {both * 1e6:.1f} us ({100 * 8 * nbytes / both / HBM:.0f}% HBM on 8 passes)", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which in ("all", "gemv"):
        gemv()
    if which in ("all", "prefill"):
        prefill()
    if which in ("all", "qat"):
        qat_step()
    if which in ("all", "glu"):
        relu2_glu()
