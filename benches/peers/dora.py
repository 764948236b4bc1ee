"""PEFT's DoRA at the shapes of kiln's `dora-bench` mode (benches/gpu_check/dora.rs), same call: a
training step (forward + backward, gradients of x, A, B and the magnitude) of a bf16 `nn.Linear`
with a rank-16 DoRA adapter (alpha 32, bf16 adapter weights as kiln's), with dropout 0.1, and on a
bitsandbytes NF4 base (QDoRA), next to the base alone and the LoRA step, 4096 tokens. PEFT forms
`B·A` and the whole weight's norm every step. Prints `peer dora`."""
import os, sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from lora import One, adapted, linear, nf4, step_seconds, STEPS, TOKENS, RANK, bf  # noqa: E402


def main():
    for k, n in STEPS:
        x = torch.randn(TOKENS, k, device="cuda", dtype=bf, requires_grad=True)
        dy = torch.randn(TOKENS, n, device="cuda", dtype=bf)
        base = linear(k, n)
        t_base = step_seconds(One(base), x, dy)
        t_lora = step_seconds(adapted(linear(k, n)), x, dy)
        t_dora = step_seconds(adapted(linear(k, n), dora=True), x, dy)
        t_drop = step_seconds(adapted(linear(k, n), dropout=0.1, dora=True), x, dy)
        t_qbase = step_seconds(One(nf4(k, n, base.weight)), x, dy)
        t_qdora = step_seconds(adapted(nf4(k, n, base.weight), dora=True), x, dy)
        print(f"peer dora step t{TOKENS} k{k} n{n} r{RANK} bf16: peft base {t_base * 1e3:.3f} ms, lora {t_lora * 1e3:.3f} ms, "
              f"dora {t_dora * 1e3:.3f} ms (+{(t_dora - t_lora) * 1e3:.3f} over lora), dora+dropout0.1 {t_drop * 1e3:.3f} ms | "
              f"bnb nf4 base {t_qbase * 1e3:.3f} ms, qdora {t_qdora * 1e3:.3f} ms", flush=True)
        del x, dy, base
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
