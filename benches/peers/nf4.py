"""bitsandbytes' NF4 (block 64, double quantization, as QLoRA uses it) and torch bf16 at the shapes
of kiln's `nf4-bench` mode (benches/gpu_check/nf4.rs), in the same call:
  * GEMV, 1, 4 and 8 rows: wall time per call (back-to-back calls, median of three samples) and the
    GPU's own time per product (300 calls queued behind `torch.cuda._sleep`, CUDA events);
    bitsandbytes' `matmul_4bit` takes its inference kernel (`gemv_4bit`) for one row and
    dequantize + matmul for more;
  * prefill products at M = 512, 1024, 2048, 8192;
  * a QLoRA step's base layer, forward + input gradient, 4096 tokens, 4096 -> 11008.
Arguments pick the parts (`gemv`, `prefill`, `qlora`; all by default). Prints lines starting with
`peer nf4`."""
import os, sys

import torch
import bitsandbytes as bnb
import bitsandbytes.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gemm import gpu_seconds, seconds  # noqa: E402

GEMV = [(4096, 4096), (4096, 11008), (11008, 4096), (8192, 28672)]
PREFILL = [(4096, 4096), (4096, 11008), (11008, 4096)]
bf = torch.bfloat16


def quantized(k, n):
    w = (torch.randn(n, k, device="cuda") * 0.02).to(bf)
    q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    return w, q, state


def packed_bytes(q, state):
    nested = state.state2
    return q.numel() + state.absmax.numel() + 4 * nested.absmax.numel() + 4 * 256 + 4


def gemv():
    for k, n in GEMV:
        w, q, state = quantized(k, n)
        for m in (1, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=bf)
            nf4 = lambda: bnb.matmul_4bit(x, q.t(), quant_state=state)
            dense = lambda: x @ w.t()
            t, g = seconds(nf4, cap=2000), gpu_seconds(nf4)
            bt, bg = seconds(dense, cap=2000), gpu_seconds(dense)
            pb = packed_bytes(q, state) + 2 * m * (k + n)
            db = 2 * (k * n + m * (k + n))
            print(f"peer nf4 gemv m{m} k{k:<6} n{n:<6} bitsandbytes: {t * 1e6:7.1f} us/call, GPU {g * 1e6:6.1f} us "
                  f"({pb / g / 1e9:5.0f} GB/s packed) | torch bf16: {bt * 1e6:7.1f} us/call, GPU {bg * 1e6:6.1f} us "
                  f"({db / bg / 1e9:5.0f} GB/s) | bnb/bf16 GPU speedup {bg / g:.2f}x", flush=True)
        del w, q, state
        torch.cuda.empty_cache()


def prefill():
    for k, n in PREFILL:
        w, q, state = quantized(k, n)
        for m in (512, 1024, 2048, 8192):
            x = torch.randn(m, k, device="cuda", dtype=bf)
            t = seconds(lambda: bnb.matmul_4bit(x, q.t(), quant_state=state), cap=200)
            bt = seconds(lambda: x @ w.t(), cap=200)
            flops = 2 * m * k * n
            print(f"peer nf4 prefill m{m:<5} k{k:<6} n{n:<6} bitsandbytes {t * 1e3:8.3f} ms ({flops / t / 1e12:4.0f} TF/s) | "
                  f"torch bf16 {bt * 1e3:8.3f} ms ({flops / bt / 1e12:4.0f} TF/s)", flush=True)
        del w, q, state
        torch.cuda.empty_cache()


def qlora_step():
    m, k, n = 4096, 4096, 11008
    _, q, state = quantized(k, n)
    x = torch.randn(m, k, device="cuda", dtype=bf, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=bf)
    y0 = torch.randn(m, n, device="cuda", dtype=bf, requires_grad=True)
    step = lambda: torch.autograd.grad((bnb.matmul_4bit(x, q.t(), quant_state=state) * dy).sum(), [x])
    loss = seconds(lambda: torch.autograd.grad((y0 * dy).sum(), [y0]), cap=50)
    t = seconds(step, cap=50)
    print(f"peer nf4 qlora step m{m} k{k} n{n} fwd+bwd(x): bitsandbytes {t * 1e3:.3f} ms ({loss * 1e3:.3f} ms of it the loss ops; "
          f"{2 * 2 * m * k * n / (t - loss) / 1e12:.0f} TF/s net)", flush=True)


if __name__ == "__main__":
    print("peer nf4 versions: torch", torch.__version__, "bitsandbytes", bnb.__version__, flush=True)
    parts = {"gemv": gemv, "prefill": prefill, "qlora": qlora_step}
    for name in sys.argv[1:] or parts:
        parts[name]()
