#!/usr/bin/env python3
"""Static view of kiln's CUDA kernels: registers, spills and the instruction mix of each loop.

Input: a CubeCL compilation log (what `cubecl.toml`'s `[compilation.logger] level = "full"`
writes; `profile.sh` makes one on the GPU machine). For every kiln kernel in it this writes, into
OUT (default: the current directory):
  <kernel>.cu     the CUDA source CubeCL generated
  <kernel>.regs   ptxas's register/spill report (nvcc -Xptxas -v, sm_90a)
  <kernel>.sass   its SASS (cuobjdump)
and prints, per kernel, the registers and, for every loop (a backward branch), its basic blocks
with their instruction counts by opcode: the hot loop of a flash-attention kernel shows how many
instructions one key tile costs and which of them are tensor-core work.

nvcc, cuobjdump and nvdisasm come from PATH (the GPU machine has them). A machine without a GPU can
get them from PyPI: `pip install --target .cuda nvidia-cuda-nvcc nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm nvidia-cuda-crt nvidia-cuda-runtime nvidia-cuda-cccl nvidia-nvvm`, then
`PATH=$PWD/.cuda/nvidia/cu13/bin:$PATH` (compiling for sm_90a needs no GPU).

Usage: sass.py LOG [OUT]
"""
import collections
import os
import re
import subprocess
import sys

# `name: kiln_kernels::<modules>::<kernel fn>::<KernelStruct><...>`
KERNEL = re.compile(r"name: kiln_kernels::([\w:]+)<")
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);")
BRANCH = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)\s+)?0x([0-9a-f]+)")


def kernel_sources(log):
    """(name, CUDA source) of each kiln kernel in the log, first occurrence of each name."""
    seen = set()
    for m in KERNEL.finditer(log):
        name = m.group(1).split("::")[-2]
        start = log.find("```", m.end())
        end = log.find("```", start + 3)
        if name in seen or start < 0 or end < 0:
            continue
        seen.add(name)
        # CubeCL declares the mbarrier pointer as its own `uint64`; nvcc wants the CUDA type.
        yield name, log[start + 3:end].split("\n", 1)[1].replace("uint64 *mbar_ptr", "auto *mbar_ptr")


def compile_kernel(name, source, out):
    """Write .cu/.regs/.sass for one kernel; returns (ptxas report, SASS text)."""
    cu, cubin = os.path.join(out, f"{name}.cu"), os.path.join(out, f"{name}.cubin")
    with open(cu, "w") as f:
        f.write(source)
    ptxas = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-std=c++17", cu, "-o", cubin],
                           capture_output=True, text=True)
    report = ptxas.stdout + ptxas.stderr
    sass = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout if ptxas.returncode == 0 else ""
    for ext, text in (("regs", report), ("sass", sass)):
        with open(os.path.join(out, f"{name}.{ext}"), "w") as f:
            f.write(text)
    return report, sass


def opcode(text):
    """The opcode family of a SASS instruction (predicate and modifiers dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loops(sass):
    """Each loop as (start, end, blocks), a block being (address, instructions)."""
    instructions = [(int(m.group(1), 16), m.group(2).strip()) for m in map(INSTRUCTION.match, sass.splitlines()) if m]
    for address, text in instructions:
        target = BRANCH.search(text)
        if not target or int(target.group(1), 16) >= address:
            continue
        start = int(target.group(1), 16)
        body = [(a, t) for a, t in instructions if start <= a <= address]
        # Spin-waits on barriers, and the out-of-line wait blocks after the exit that jump back.
        if len(body) < 8 or any("EXIT" in t for _, t in body):
            continue
        targets = {int(b.group(1), 16) for b in (BRANCH.search(t) for _, t in body) if b}
        blocks, current = [], []
        for a, t in body:
            if a in targets and current:
                blocks.append(current)
                current = []
            current.append((a, t))
            if "BRA" in t or "EXIT" in t:
                blocks.append(current)
                current = []
        if current:
            blocks.append(current)
        yield start, address, blocks


def main():
    log_path, out = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "."
    os.makedirs(out, exist_ok=True)
    with open(log_path, errors="replace") as f:
        log = f.read()
    for name, source in kernel_sources(log):
        report, sass = compile_kernel(name, source, out)
        usage = [line.strip() for line in report.splitlines() if "registers" in line or "spill" in line]
        print(f"== {name}: {'; '.join(usage) or report.strip()}")
        for start, end, blocks in loops(sass):
            total = sum(len(b) for b in blocks)
            print(f"  loop {start:#x}..{end:#x}: {total} instructions in {len(blocks)} blocks")
            for block in blocks:
                counts = collections.Counter(opcode(t) for _, t in block)
                mix = " ".join(f"{op}:{n}" for op, n in counts.most_common(8))
                print(f"    {block[0][0]:#07x} {len(block):4}  {mix}")


if __name__ == "__main__":
    main()
