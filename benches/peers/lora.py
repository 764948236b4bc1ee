"""PEFT's LoRA at the shapes of kiln's `lora-bench` mode (benches/gpu_check/lora.rs), same call:
a training step (forward + backward, gradients of x, A and B) of a bf16 `nn.Linear` with a rank-16
adapter (alpha 32; bf16 adapter weights as kiln's, `autocast_adapter_dtype=False`; PEFT's default
fp32 adapters beside), with dropout 0.1, and on a bitsandbytes NF4 base (QLoRA), each next to the
base alone, 4096 tokens. The step's loss is `(y * dy).sum()` as in kiln's. Prints `peer lora`."""
import os, sys

import torch
import bitsandbytes as bnb
from peft import LoraConfig, get_peft_model

sys.path.insert(0, os.path.dirname(__file__))
from gemm import seconds  # noqa: E402

STEPS = [(4096, 4096), (4096, 11008)]
# kiln's `KILN_LORA_TOKENS` / `KILN_LORA_RANK` are `LORA_TOKENS` / `LORA_RANK` here.
TOKENS, RANK = int(os.environ.get("LORA_TOKENS", 4096)), int(os.environ.get("LORA_RANK", 16))
bf = torch.bfloat16


class One(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.proj = layer

    def forward(self, x):
        return self.proj(x)


def linear(k, n):
    layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=bf)
    layer.weight.requires_grad_(False)
    return layer


def nf4(k, n, weight):
    layer = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=bf, compress_statistics=True, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(weight.detach().cpu(), requires_grad=False, compress_statistics=True, quant_type="nf4")
    return layer.cuda()


def adapted(base, dropout=0.0, fp32=False, dora=False):
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=dropout, target_modules=["proj"], init_lora_weights=False, use_dora=dora)
    return get_peft_model(One(base), config, autocast_adapter_dtype=fp32)


def step_seconds(model, x, dy):
    def run():
        x.grad = None
        for p in model.parameters():
            p.grad = None
        (model(x) * dy).sum().backward()
        return x.grad
    return seconds(run, cap=100)


def main():
    for k, n in STEPS:
        x = torch.randn(TOKENS, k, device="cuda", dtype=bf, requires_grad=True)
        dy = torch.randn(TOKENS, n, device="cuda", dtype=bf)
        base = linear(k, n)
        t_base = step_seconds(One(base), x, dy)
        t_lora = step_seconds(adapted(linear(k, n)), x, dy)
        t_lora32 = step_seconds(adapted(linear(k, n), fp32=True), x, dy)
        t_drop = step_seconds(adapted(linear(k, n), dropout=0.1), x, dy)
        q = nf4(k, n, base.weight)
        t_qbase = step_seconds(One(q), x, dy)
        t_qlora = step_seconds(adapted(nf4(k, n, base.weight)), x, dy)
        print(f"peer lora step t{TOKENS} k{k} n{n} r{RANK} bf16: peft base {t_base * 1e3:.3f} ms, lora {t_lora * 1e3:.3f} ms "
              f"(+{(t_lora - t_base) * 1e3:.3f}; fp32 adapters {t_lora32 * 1e3:.3f}), lora+dropout0.1 {t_drop * 1e3:.3f} ms | "
              f"bnb nf4 base {t_qbase * 1e3:.3f} ms, qlora {t_qlora * 1e3:.3f} ms (+{(t_qlora - t_qbase) * 1e3:.3f})", flush=True)
        del x, dy, base, q
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
