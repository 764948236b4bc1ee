"""Peer timings for kiln's attention benches: torch SDPA at the shapes of gpu_check's
bench_attention (batch x seq = 16k tokens, 2048 model width), forward and forward+backward TFLOP/s
(backward = 2.5 x forward FLOPs), the memory held for the backward, and one decoding step.
`attention.py fwd` times the forward alone (gpu_check's attention-fwd mode); `attention.py
backends` times SDPA's FlashAttention-2 backend (torch's FLASH_ATTENTION, mma.sync like kiln) and its
cuDNN backend separately at hd64/hd128, s4096 and s16384. Prints lines starting with `peer`."""
import sys

import torch
import torch.nn.functional as F

from timing import fwd_bwd, ms

dev = "cuda"
bf = torch.bfloat16
forward_only = sys.argv[1:] == ["fwd"]
backends = sys.argv[1:] == ["backends"]

def sdpa_line(label, hd, seq, causal, with_backward):
    """One `peer` line: SDPA at head size `hd`, length `seq` (batch x seq = 16k tokens, 2048 model
    width), forward and (with `with_backward`) forward+backward, under whatever backend is active."""
    b, h = 16384 // seq, 2048 // hd
    q, k, v = (torch.randn(b, h, seq, hd, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, seq, hd, device=dev, dtype=bf)
    flops = 4 * b * h * seq * seq * hd * (0.5 if causal else 1.0)
    with torch.no_grad():
        f = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    line = f"peer torch {label} hd{hd} s{seq} b{b} h{h} causal={causal!s:<5} fwd {f:8.3f} ms {flops / f / 1e9:6.1f} TF/s"
    if with_backward:
        fb = ms(fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), [q, k, v], do))
        line += f"  fwd+bwd {fb:8.3f} ms {3.5 * flops / fb / 1e9:6.1f} TF/s"
    print(line, flush=True)


if backends:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("flash2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        for hd in (64, 128):
            for seq in (4096, 16384):
                for causal in (False, True):
                    with sdpa_kernel(backend):
                        sdpa_line(f"sdpa[{name}]", hd, seq, causal, True)
    sys.exit(0)

for hd in (64, 128):
    for seq in (1024, 4096, 8192, 16384):
        for causal in (False, True):
            sdpa_line("sdpa", hd, seq, causal, not forward_only)

if forward_only:
    sys.exit(0)

# Memory held after the forward for the backward, causal s16k h2 d128.
q, k, v = (torch.randn(1, 2, 16384, 128, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
torch.cuda.synchronize()
base = torch.cuda.memory_allocated()
out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize()
print(f"peer torch sdpa memory after forward (autograd), causal s16384 h2 d128 bf16: {(torch.cuda.memory_allocated() - base) / 1e9:.3f} GB")
del out, q, k, v

# Decoding: one query token, 32 q heads over an 8-kv-head cache of 32768 positions.
q = torch.randn(1, 32, 1, 128, device=dev, dtype=bf)
k, v = (torch.randn(1, 8, 32768, 128, device=dev, dtype=bf) for _ in range(2))
with torch.no_grad():
    t = ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
print(f"peer torch sdpa decode q1 hq32 hk8 cache32768 d128: {t * 1e3:.1f} us ({2 * 8 * 32768 * 128 * 2 / (t * 1e-3) / 1e9:.0f} GB/s of K+V)")
