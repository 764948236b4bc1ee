"""torch peers of kiln's `sketch` mode (benches/gpu_check/sketch.rs), same call, at a Llama-7B MLP
weight (4096 x 11008 f32 values): a count sketch with its index map stored (bucket and sign per
value: what kiln recomputes instead), compress by `index_add_` and decompress by a gather, at
ratios 2, 4 and 16; and torch's fused AdamW step on that parameter. Prints lines starting with
`peer sketch`."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gemm import seconds  # noqa: E402

N = 4096 * 11008


def sketch():
    g = torch.randn(N, device="cuda")
    for r in (2, 4, 16):
        d = (N + r - 1) // r
        bucket = torch.randperm(N, device="cuda") // r
        sign = torch.randint(0, 2, (N,), device="cuda", dtype=torch.float32) * 2 - 1
        compress = lambda: torch.zeros(d, device="cuda").index_add_(0, bucket, g * sign)
        c = compress()
        decompress = lambda: c[bucket] * sign
        tc, td = seconds(compress, cap=100), seconds(decompress, cap=100)
        index_mb = (bucket.numel() * bucket.element_size() + sign.numel() * sign.element_size()) / 1e6
        print(f"peer sketch n {N} ratio {r}: compress {tc * 1e3:.3f} ms ({4 * N / tc / 1e9:.0f} GB/s of f32 in), "
              f"decompress {td * 1e3:.3f} ms ({4 * N / td / 1e9:.0f} GB/s of f32 out), index map {index_mb:.0f} MB", flush=True)
        del bucket, sign, c
        torch.cuda.empty_cache()


def adamw():
    p = torch.nn.Parameter(torch.randn(4096, 11008, device="cuda") * 0.02)
    p.grad = torch.randn_like(p)
    for fused in (True, False):
        opt = torch.optim.AdamW([p], lr=1e-3, fused=fused, foreach=None if fused else False)
        t = seconds(opt.step, cap=100)
        print(f"peer sketch optimizer step [4096, 11008] f32: torch AdamW (fused={fused}) {t * 1e3:.3f} ms, "
              f"state {8 * N / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    print("peer sketch versions: torch", torch.__version__, flush=True)
    sketch()
    adamw()
