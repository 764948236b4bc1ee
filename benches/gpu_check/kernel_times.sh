#!/usr/bin/env bash
# A command's GPU time by kernel (kernel_times.c, CUPTI's activity API), on the GPU machine: builds
# kernel_times.so beside this script against the CUDA toolkit's CUPTI (the newest kernel record
# its headers define), then runs the command with it preloaded. Run it twice with different step
# counts and difference the totals for a step's share (benches/RESULTS.md, 46th session).
#   gpu/kernel_times.sh gpu/kiln-qat-step --batch 2 --seq 2048 --warmup 2 --steps 8
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
inc=$(find /usr/local /opt /usr/include -name cupti.h 2>/dev/null | head -1)
lib=$(find /usr/local /opt /usr/lib -name "libcupti.so*" 2>/dev/null | grep -v stub | head -1)
[ -n "$inc" ] && [ -n "$lib" ] || { echo "kernel_times: no CUPTI headers or library found" >&2; exit 1; }
if [ ! -f "$here/kernel_times.so" ]; then
  for v in 12 11 10 9 8; do
    gcc -O2 -Wall -shared -fPIC -DKILN_KERNEL_T=CUpti_ActivityKernel$v -I"$(dirname "$inc")" -o "$here/kernel_times.so" \
      "$here/kernel_times.c" -L"$(dirname "$lib")" -l:"$(basename "$lib")" 2>/dev/null && break
  done
  [ -f "$here/kernel_times.so" ] || { echo "kernel_times: no CUpti_ActivityKernel record in $inc" >&2; exit 1; }
fi
# kiln loads CUPTI itself (to learn CubeCL's stream): the same library must serve both.
LD_LIBRARY_PATH="$(dirname "$lib"):${LD_LIBRARY_PATH:-}" LD_PRELOAD="$here/kernel_times.so" exec "$@"
