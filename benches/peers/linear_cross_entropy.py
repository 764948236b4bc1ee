"""Peer timings for kiln's fused linear cross-entropy (`kiln-gpu-check linear-cross-entropy`),
same shapes, same call: torch's head product followed by `cross_entropy` on an f32 copy of the
logits (what transformers' loss does) and on the bf16 logits, and Liger-Kernel's
`LigerFusedLinearCrossEntropyLoss` (chunked, gradients taken in its forward). The weight is
`[vocab, d]` bf16, trained or frozen (QLoRA's head); mean over counted rows, every tenth target
ignored (-100). Prints lines starting with `peer`: time per forward + backward, what the forward
keeps allocated for its backward, and the step's peak above its inputs."""
import torch
import torch.nn.functional as F

from timing import ms

dev = "cuda"
SHAPES = [(8192, 2048, 128256), (4096, 4096, 128256), (4096, 3584, 152064)]

try:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    import liger_kernel  # noqa: F401
    liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
    print("peer liger-kernel", getattr(liger_kernel, "__version__", "0.8.5"))
except Exception as e:  # noqa: BLE001
    print("peer liger-kernel unavailable:", e)
    liger = None


def memory(fn):
    """(bytes the forward keeps for its backward, peak bytes of forward + backward above the start)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss = fn()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - start
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    return held, peak, loss.item()


for rows, d, vocab in SHAPES:
    h = torch.randn(rows, d, device=dev).to(torch.bfloat16)
    w = (torch.randn(vocab, d, device=dev) * 0.05).to(torch.bfloat16)
    r = torch.arange(rows, device=dev, dtype=torch.int64)
    t = (r * 2654435761) % vocab
    t[r % 10 == 3] = -100
    shape = f"[{rows}, {d}] x [{d}, {vocab}] bf16"
    ways = [("torch linear + cross_entropy(logits.float())", lambda: F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)),
            ("torch linear + cross_entropy(bf16 logits)", lambda: F.cross_entropy(F.linear(h, w), t, ignore_index=-100))]
    if liger is not None:
        ways.append(("liger LigerFusedLinearCrossEntropyLoss", lambda: liger(w, h, t)))
    for trained in (True, False):
        h.requires_grad_(True)
        w.requires_grad_(trained)
        weight = "trained" if trained else "frozen"
        for name, fn in ways:
            held, peak, loss = memory(fn)

            def step():
                h.grad = None
                w.grad = None
                fn().backward()
            print(f"peer {name + ', weight ' + weight + ' ' + shape:<100} {ms(step):8.3f} ms  holds {held / 1e6:.1f} MB, "
                  f"peak {peak / 1e6:.1f} MB, mean loss {loss:.6f}")
            h.grad = None
            w.grad = None
    del h, w, t
    torch.cuda.empty_cache()
