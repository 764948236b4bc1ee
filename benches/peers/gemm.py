"""torch.matmul at the shapes of kiln's GEMM table (benches/gpu_check/gemm.rs), timed the way the
Rust side times: back-to-back calls, wall clock between device syncs, as many calls per sample as
fit ~0.1 s, median of three samples. f32 runs with TF32 allowed (what kiln and Burn do for f32).
`linear`: a bias-free linear layer's forward + backward (dX, dW) in bf16 at the shapes of
kiln's `gemm-linear` mode, and the loss ops alone (Σ y·dy on a leaf), both through autograd, 10
calls per sample (the gradients kept alive would not fit with more).
`small`: bf16 products of M = 1, 4, 16 rows (kiln's `gemm-skinny` mode), per call as above and
the GPU's own time per call (300 calls queued behind `torch.cuda._sleep`, CUDA events around
them, median of three).
Usage: python3 gemm.py [bf16|f32|all|linear|small]. Prints lines starting with `peer gemm`/`peer linear`."""
import sys
import time

import torch

MS = [1, 16, 512, 2048, 8192, 16384]
KNS = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 128256)]
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def seconds(fn, cap=500):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    iters = int(min(cap, max(3, 0.1 / (time.perf_counter() - start))))
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        results = [fn() for _ in range(iters)]
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / iters)
        del results
    return sorted(samples)[1]


def main(which):
    torch.backends.cuda.matmul.allow_tf32 = True
    for name, dtype in DTYPES.items():
        if which not in ("all", name):
            continue
        for k, n in KNS:
            w = torch.randn(k, n, device="cuda", dtype=dtype)
            for m in MS:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                t = seconds(lambda: x @ w)
                print(f"peer gemm torch {name} m{m:<6} k{k:<6} n{n:<7} {t * 1e3:9.4f} ms {2 * m * k * n / t / 1e12:6.1f} TF/s", flush=True)
                del x
            del w
            torch.cuda.empty_cache()


def gpu_seconds(fn, calls=300):
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100_000_000)  # keeps the GPU busy while the calls are enqueued
        start.record()
        results = [fn() for _ in range(calls)]
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
        del results
    return sorted(samples)[1]


def small():
    for k, n in KNS:
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        for m in [1, 4, 16]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t, g = seconds(lambda: x @ w, cap=2000), gpu_seconds(lambda: x @ w)
            gbs = 2 * (k * n + m * k + m * n) / g / 1e9
            print(f"peer gemm small torch bf16 m{m:<3} k{k:<6} n{n:<7} us/call {t * 1e6:7.1f}  GPU {g * 1e6:7.1f} us/product, {gbs:5.0f} GB/s", flush=True)
        del w
        torch.cuda.empty_cache()


def linear():
    bf = torch.bfloat16
    for m, k, n in [(8192, 4096, 11008), (8192, 11008, 4096), (8192, 4096, 4096), (2048, 4096, 4096)]:
        x = torch.randn(m, k, device="cuda", dtype=bf, requires_grad=True)
        w = torch.randn(n, k, device="cuda", dtype=bf, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=bf)
        y0 = torch.randn(m, n, device="cuda", dtype=bf, requires_grad=True)
        loss = seconds(lambda: torch.autograd.grad((y0 * dy).sum(), [y0]), cap=10)
        t = seconds(lambda: torch.autograd.grad((torch.nn.functional.linear(x, w) * dy).sum(), [x, w]), cap=10)
        flops = 3 * 2 * m * k * n
        print(f"peer linear torch fwd+bwd bf16 m{m} k{k} n{n}: loss ops {loss * 1e3:.4f} ms; torch {t * 1e3:.4f} ms ({flops / (t - loss) / 1e12:.0f} TF/s net)", flush=True)
        del x, w, dy, y0
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("linear", "small"):
        {"linear": linear, "small": small}[sys.argv[1]]()
        sys.exit(0)
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
