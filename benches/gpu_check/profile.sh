#!/usr/bin/env bash
# Profile the tensor-core attention kernels on the GPU machine (run from the folder that holds
# kiln-gpu-check, i.e. after `scripts/gpu-check-build`, as `gpu/profile.sh`). Writes to $OUT:
#   <kernel>.regs   nvcc's register/spill report for the CUDA source CubeCL generated
#   <kernel>.sass   its SASS (cuobjdump)
#   ncu_fwd.txt, ncu_fwd_raw.csv, ncu_fwd_source.csv   Nsight Compute on one forward launch
#                   (hd128 s4096 non-causal, the `attention-quick` shape)
set -u
here=$(dirname "$0")
out=${OUT:-/tmp/kiln-profile}
mkdir -p "$out"
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}

# CubeCL logs each kernel's generated source; rebuild it with nvcc for registers and SASS.
CUBECL_DEBUG_LOG=/tmp/kiln-kernels.log timeout 200 "$here/kiln-gpu-check" attention-quick > "$out/quick.txt" 2>&1
python3 - /tmp/kiln-kernels.log "$out" <<'PY'
import re, subprocess, sys
log, out = open(sys.argv[1], errors="replace").read(), sys.argv[2]
for m in re.finditer(r"name: kiln_kernels::flash_attention::mma::\w+::(\w+)", log):
    name = m.group(1)
    a = log.find("```", m.end()); b = log.find("```", a + 3)
    # CubeCL declares the mbarrier pointer as its own `uint64`; nvcc wants the CUDA type.
    src = log[a + 3:b].split("\n", 1)[1].replace("uint64 *mbar_ptr", "auto *mbar_ptr")
    open(f"/tmp/{name}.cu", "w").write(src)
    r = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-std=c++17", f"/tmp/{name}.cu", "-o", f"/tmp/{name}.cubin"], capture_output=True, text=True)
    open(f"{out}/{name}.regs", "w").write(r.stdout + r.stderr)
    sass = subprocess.run(["cuobjdump", "-sass", f"/tmp/{name}.cubin"], capture_output=True, text=True).stdout
    open(f"{out}/{name}.sass", "w").write(sass)
PY

# The 4th forward launch of attention-quick is the last timed non-causal one.
ncu --clock-control none -k regex:mma_forward --launch-skip 3 --launch-count 1 --set full -o /tmp/kiln-fwd -f \
  timeout 300 "$here/kiln-gpu-check" attention-quick > "$out/ncu_run.txt" 2>&1
ncu --import /tmp/kiln-fwd.ncu-rep --page details > "$out/ncu_fwd.txt" 2>&1
ncu --import /tmp/kiln-fwd.ncu-rep --page raw --csv > "$out/ncu_fwd_raw.csv" 2>&1
ncu --import /tmp/kiln-fwd.ncu-rep --page source --csv --print-source sass > "$out/ncu_fwd_source.csv" 2>&1
grep -h "registers\|spill" "$out"/*.regs
