"""Peer timings for kiln's GPU check, run in the same call on the same GPU: torch eager and
Liger-Kernel for RMSNorm, SwiGLU and RoPE at the shapes benches/gpu_check.rs uses, plus the
device-to-device copy rate that "% of copy" refers to. Prints lines starting with `peer`."""
import torch

from timing import fwd_bwd, ms

dev = "cuda"
bf = torch.bfloat16


def line(name, t_ms, nbytes, copy):
    rate = nbytes / (t_ms * 1e-3)
    print(f"peer {name:<52} {t_ms:9.3f} ms {rate / 1e9:7.0f} GB/s {100 * rate / copy:5.1f}% of copy")


big = torch.randn(16384, 8192, device=dev, dtype=bf)
dst = torch.empty_like(big)
copy = 2 * big.numel() * 2 / (ms(lambda: dst.copy_(big)) * 1e-3)
print(f"peer d2d copy bf16 [16384,8192]: {copy / 1e9:.0f} GB/s (read + write)")
del big, dst

try:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    import liger_kernel
    print("peer liger-kernel", getattr(liger_kernel, "__version__", "0.8.5"))
    have_liger = True
except Exception as e:  # noqa: BLE001
    print("peer liger-kernel unavailable:", e)
    have_liger = False


def torch_rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf) * w


# RMSNorm at gpu_check's shapes: [16384, 4096], and a Llama-3.2-1B layer's 2 × 2048 tokens.
for T, H in [(16384, 4096), (4096, 2048)]:
    x = torch.randn(T, H, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(H, device=dev, dtype=bf, requires_grad=True)
    dy = torch.randn(T, H, device=dev, dtype=bf)
    n = T * H
    shape = f"[{T},{H}]"
    with torch.no_grad():
        line(f"torch eager rms_norm fwd bf16 {shape}", ms(lambda: torch_rms(x, w)), 2 * n * 2, copy)
        if have_liger:
            line(f"liger rms_norm fwd bf16 {shape}", ms(lambda: LigerRMSNormFunction.apply(x, w, 1e-6)), 2 * n * 2, copy)
    line(f"torch eager rms_norm fwd+bwd bf16 {shape}", ms(fwd_bwd(lambda: torch_rms(x, w), [x, w], dy)), 5 * n * 2, copy)
    if have_liger:
        line(f"liger rms_norm fwd+bwd bf16 {shape}", ms(fwd_bwd(lambda: LigerRMSNormFunction.apply(x, w, 1e-6), [x, w], dy)), 5 * n * 2, copy)
    del x, w, dy

# SwiGLU [16384, 11008]
T, F = 16384, 11008
g = torch.randn(T, F, device=dev, dtype=bf, requires_grad=True)
u = torch.randn(T, F, device=dev, dtype=bf, requires_grad=True)
dy = torch.randn(T, F, device=dev, dtype=bf)
n = T * F
with torch.no_grad():
    line("torch eager silu(g)*u fwd bf16 [16384,11008]", ms(lambda: torch.nn.functional.silu(g) * u), 3 * n * 2, copy)
    if have_liger:
        line("liger swiglu fwd bf16 [16384,11008]", ms(lambda: LigerSiLUMulFunction.apply(g, u)), 3 * n * 2, copy)
line("torch eager silu(g)*u fwd+bwd bf16", ms(fwd_bwd(lambda: torch.nn.functional.silu(g) * u, [g, u], dy)), 8 * n * 2, copy)
if have_liger:
    line("liger swiglu fwd+bwd bf16", ms(fwd_bwd(lambda: LigerSiLUMulFunction.apply(g, u), [g, u], dy)), 8 * n * 2, copy)
del g, u, dy

# RoPE q [4, 32, 4096, 128], k [4, 8, 4096, 128] (HF layout [b, h, s, d])
B, S, HQ, HK, D = 4, 4096, 32, 8, 128
q = torch.randn(B, HQ, S, D, device=dev, dtype=bf, requires_grad=True)
k = torch.randn(B, HK, S, D, device=dev, dtype=bf, requires_grad=True)
inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
ang = torch.outer(torch.arange(S, device=dev).float(), inv)
emb = torch.cat([ang, ang], -1)
cos, sin = emb.cos().to(bf)[None], emb.sin().to(bf)[None]


def rot(x):
    return torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)


def torch_rope(q, k):
    c, s = cos[:, None], sin[:, None]
    return q * c + rot(q) * s, k * c + rot(k) * s


nq = B * S * HQ * D
nqk = B * S * (HQ + HK) * D
with torch.no_grad():
    line("torch eager rope fwd bf16 q+k", ms(lambda: torch_rope(q, k)), 2 * nqk * 2, copy)
    if have_liger:
        line("liger rope fwd bf16 q+k", ms(lambda: LigerRopeFunction.apply(q, k, cos, sin)), 2 * nqk * 2, copy)
del q, k

# Attention: torch SDPA, its own script (also run alone: `attention.py fwd`).
import runpy
import os

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention.py"))
