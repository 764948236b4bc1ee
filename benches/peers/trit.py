"""torch peers of kiln's `trit-bench` mode (benches/gpu_check/trit.rs), same call: similarity search
of 1, 8 and 64 ternary queries against 1M stored vectors of 10 000 trits, held one byte a trit
(int8, `torch._int_mm`, i32 scores: exact) and as bf16 (a matmul with f32 accumulation, scores
rounded to bf16: not exact), each followed by a top-10; then bind (elementwise product) and bundle
(sign of the column sums) on 100 000 × 10 000 int8 trits. `_int_mm` needs a multiple of 8 query
columns: fewer queries are padded to 8. Prints lines starting with `peer trit`."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gemm import seconds  # noqa: E402

STORED, LEN, HBM = 1_000_000, 10_000, 3.35e12


def ternary(rows, cols, dtype=torch.int8):
    """Random trits in {-1, 0, 1} (density 1/2 as kiln's bench), built in slices to bound the
    temporary memory."""
    out = torch.empty(rows, cols, device="cuda", dtype=dtype)
    step = 100_000
    for r in range(0, rows, step):
        n = min(step, rows - r)
        nonzero = torch.rand(n, cols, device="cuda") < 0.5
        sign = torch.randint(0, 2, (n, cols), device="cuda", dtype=torch.int8) * 2 - 1
        out[r:r + n] = (sign * nonzero).to(dtype)
    return out


def search():
    memory = ternary(STORED, LEN)
    for q in (1, 8, 64):
        b = ternary(max(8, q), LEN).t()
        scores = lambda: torch._int_mm(memory, b)
        search = lambda: torch.topk(torch._int_mm(memory, b)[:, :q].t(), 10, dim=1)
        t, s = seconds(scores, cap=200), seconds(search, cap=200)
        print(f"peer trit int8 {q:>2} queries vs {STORED} x {LEN}: scores {t * 1e3:8.3f} ms "
              f"({STORED * LEN / t / 1e9:5.0f} GB/s of int8, {100 * STORED * LEN / t / HBM:4.1f}% of HBM) | "
              f"search top-10 {s * 1e3:8.3f} ms", flush=True)
    del memory
    torch.cuda.empty_cache()
    memory = ternary(STORED, LEN, torch.bfloat16)
    for q in (1, 8, 64):
        b = ternary(q, LEN, torch.bfloat16).t()
        scores = lambda: memory @ b
        search = lambda: torch.topk((memory @ b).t(), 10, dim=1)
        t, s = seconds(scores, cap=200), seconds(search, cap=200)
        print(f"peer trit bf16 {q:>2} queries vs {STORED} x {LEN}: scores {t * 1e3:8.3f} ms "
              f"({2 * STORED * LEN / t / 1e9:5.0f} GB/s of bf16, {100 * 2 * STORED * LEN / t / HBM:4.1f}% of HBM) | "
              f"search top-10 {s * 1e3:8.3f} ms", flush=True)
    del memory
    torch.cuda.empty_cache()


def bind_bundle():
    rows = 100_000
    batch = ternary(rows, LEN)
    key = ternary(1, LEN)
    trits = rows * LEN
    bind = seconds(lambda: batch * key, cap=200)
    bundle = seconds(lambda: torch.sign(batch.sum(0, dtype=torch.int32)), cap=200)
    roll = seconds(lambda: torch.roll(batch, 12_345, dims=1), cap=200)
    print(f"peer trit int8 {rows} x {LEN}: bind with one key {bind * 1e3:.3f} ms ({trits / bind:.2e} trits/s, "
          f"{100 * 2 * trits / bind / HBM:.1f}% of HBM) | bundle {bundle * 1e3:.3f} ms ({trits / bundle:.2e} trits/s, "
          f"{100 * trits / bundle / HBM:.1f}% of HBM) | permute (roll) {roll * 1e3:.3f} ms ({trits / roll:.2e} trits/s)", flush=True)


if __name__ == "__main__":
    print("peer trit versions: torch", torch.__version__, flush=True)
    search()
    bind_bundle()
