"""kiln's BitNet QAT training step (models/examples/qat_step.rs) next to the same model with float
linears, each in its own process, with each process's peak device memory (`nvidia-smi` polled
every 50 ms, as `qlora_step.py` reads it), and the QAT model again without each BitLinear's own
input RMSNorm (what those norms cost). Both sides are kiln; the comparison is the issue's "QAT
step against the same model in bf16".

Usage on the GPU machine: python3 qat_step.py ./kiln-qat-step [--batch 2] [--seq 2048] [...]"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qlora_step import run_with_peak  # noqa: E402


def main():
    binary, rest = sys.argv[1], sys.argv[2:]
    runs = (("kiln qat_step float", ["--float"]), ("kiln qat_step BitNet QAT", []),
            ("kiln qat_step BitNet QAT without the linears' input norms", ["--no-input-norm"]))
    for label, extra in runs:
        run_with_peak([binary, *rest, *extra], label)


if __name__ == "__main__":
    main()
