#!/usr/bin/env bash
# Profile the tensor-core attention kernels on the GPU machine (run from the folder that holds
# kiln-gpu-check, i.e. after `scripts/gpu-check-build`, as `gpu/profile.sh`). Writes to $OUT:
#   <kernel>.cu/.regs/.sass   the CUDA source CubeCL generated, ptxas's register/spill report and
#                             its SASS (sass.py; sass.txt has each loop's instruction mix)
#   ncu_<kernel>.txt, _raw.csv, _source.csv   Nsight Compute on one launch of the kernel named by
#                   the first argument (`forward`, the default, or `backward`), hd128 s4096
#                   non-causal: the `attention-quick` shape
# The device tool returns at most 8 files from $OUT, so everything lands in $OUT/profile.tar.xz,
# next to sass.txt and the register summary (regs.txt).
set -u
here=$(cd "$(dirname "$0")" && pwd)
final=${OUT:-/tmp/kiln-profile}
out=$(mktemp -d)
mkdir -p "$final"
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}

# Log only the compiled sources. CUBECL_DEBUG_LOG also turns on CubeCL's profiling and autotune
# logs; with it, attention-quick had not got past its first attention kernel after 250 s. CubeCL
# reads cubecl.toml from the working directory up.
work=$(mktemp -d)
printf '[compilation.logger]\nlevel = "full"\nfile = "%s/kernels.log"\n' "$work" > "$work/cubecl.toml"
(cd "$work" && timeout 200 "$here/kiln-gpu-check" attention-quick > "$out/quick.txt" 2>&1)
python3 "$here/sass.py" "$work/kernels.log" "$out" > "$out/sass.txt" 2>&1

# The 4th launch of either kernel in attention-quick is a timed non-causal one.
kernel=${1:-forward}
ncu --clock-control none -k "regex:mma_$kernel" --launch-skip 3 --launch-count 1 --set full -o "/tmp/kiln-$kernel" -f \
  timeout 300 "$here/kiln-gpu-check" attention-quick > "$out/ncu_run.txt" 2>&1
ncu --import "/tmp/kiln-$kernel.ncu-rep" --page details > "$out/ncu_$kernel.txt" 2>&1
ncu --import "/tmp/kiln-$kernel.ncu-rep" --page raw --csv > "$out/ncu_${kernel}_raw.csv" 2>&1
ncu --import "/tmp/kiln-$kernel.ncu-rep" --page source --csv --print-source sass > "$out/ncu_${kernel}_source.csv" 2>&1
grep -h "registers\|spill" "$out"/*.regs | tee "$final/regs.txt"
cp "$out/sass.txt" "$final/"
tar -C "$out" -cJf "$final/profile.tar.xz" .
