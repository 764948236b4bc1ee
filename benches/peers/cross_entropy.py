"""Peer timings for kiln's cross-entropy (`kiln-gpu-check cross-entropy`), same shapes, same call:
torch's `cross_entropy` on an f32 copy of the logits (what transformers' loss does), on the bf16
logits directly, and Liger-Kernel's `LigerCrossEntropyLoss` (its forward writes the gradient over
the logits). Mean over counted rows, every tenth target ignored (-100). Prints lines starting
with `peer`: time per call and what the forward keeps allocated for its backward."""
import torch
import torch.nn.functional as F

from timing import ms

dev = "cuda"
HBM = 3.35e12
SHAPES = [(8192, 128256), (4096, 151936), (16384, 32000)]

try:
    from liger_kernel.transformers import LigerCrossEntropyLoss
    import liger_kernel  # noqa: F401
    liger = LigerCrossEntropyLoss(ignore_index=-100)
    print("peer liger-kernel", getattr(liger_kernel, "__version__", "0.8.5"))
except Exception as e:  # noqa: BLE001
    print("peer liger-kernel unavailable:", e)
    liger = None


def line(name, t_ms, nbytes, held=None):
    rate = nbytes / (t_ms * 1e-3)
    extra = "" if held is None else f"  holds {held / 1e6:.1f} MB for the backward"
    print(f"peer {name:<60} {t_ms:8.3f} ms {rate / 1e9:6.0f} GB/s {100 * rate / HBM:5.1f}% of HBM{extra}")


def held_by(fn):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before, out


for rows, vocab in SHAPES:
    z = (torch.randn(rows, vocab, device=dev) * 2).to(torch.bfloat16).requires_grad_(True)
    r = torch.arange(rows, device=dev, dtype=torch.int64)
    t = (r * 2654435761) % vocab
    t[r % 10 == 3] = -100
    nbytes = rows * vocab * 2
    shape = f"[{rows}, {vocab}] bf16"
    ways = [("torch cross_entropy(logits.float())", lambda: F.cross_entropy(z.float(), t, ignore_index=-100)),
            ("torch cross_entropy(bf16 logits)", lambda: F.cross_entropy(z, t, ignore_index=-100))]
    if liger is not None:
        ways.append(("liger LigerCrossEntropyLoss", lambda: liger(z, t)))
    for name, fn in ways:
        if not name.startswith("liger"):
            with torch.no_grad():
                line(f"{name} fwd {shape}", ms(fn), nbytes)
        held, loss = held_by(fn)
        loss_value = loss.item()
        del loss

        def step():
            z.grad = None
            fn().backward()
        line(f"{name} fwd+bwd {shape}", ms(step), 3 * nbytes, held)
        print(f"peer {name} {shape} mean loss {loss_value:.6f}")
        z.grad = None
    del z, t
    torch.cuda.empty_cache()
