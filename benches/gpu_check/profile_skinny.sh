#!/usr/bin/env bash
# Kernel times of kiln's skinny products under Nsight Compute, one line per Llama layer shape:
#   gpu/profile_skinny.sh M [VAR=VALUE ...]
# runs `kiln-gpu-check gemm-skinny-kernels M` (five products per shape on CubeBackend) with the
# given environment (e.g. KILN_SKINNY_COLUMNS=8 KILN_SKINNY_SPLITS=4) and prints, per shape, the
# median GPU time of a product (all its kernels), the DRAM throughput of its main kernel as a
# fraction of peak, and its grid and block.
set -u
here=$(cd "$(dirname "$0")" && pwd)
m=$1; shift
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
csv=$(mktemp)
env "$@" ncu --clock-control none -k regex:skinny --csv \
  --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread \
  "$here/kiln-gpu-check" gemm-skinny-kernels "$m" > "$csv" 2>&1
python3 - "$csv" "$m" "$*" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 12 and r[0].isdigit()]
launches = {}
for r in rows:
    launch = launches.setdefault(int(r[0]), {"name": r[4], "grid": r[8], "block": r[7]})
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(r[13], 1.0) if r[12].startswith("gpu__time") else 1.0
    launch[r[12]] = float(r[14].replace(",", "")) * scale
products = []
for i in sorted(launches):
    l = launches[i]
    if "combine" in l["name"] and products:
        products[-1]["time"] += l["gpu__time_duration.sum"]
        continue
    products.append({"time": l["gpu__time_duration.sum"], "dram": l.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", 0), "grid": l["grid"], "block": l["block"], "regs": l.get("launch__registers_per_thread", 0)})
shapes = ["k4096 n4096", "k4096 n11008", "k11008 n4096", "k4096 n128256"]
for s, chunk in zip(shapes, [products[i:i + 5] for i in range(0, len(products), 5)]):
    t = statistics.median(p["time"] for p in chunk)
    p = chunk[-1]
    print(f"ncu skinny m{sys.argv[2]} {s:<14} [{sys.argv[3]}] {t:7.1f} us  dram {p['dram']:5.1f}%  grid {p['grid']} block {p['block']} regs {p['regs']:.0f}")
if not products:
    print(open(sys.argv[1]).read()[-2000:])
PY
