#!/usr/bin/env bash
# The CPU backend's FP8 GEMM against OpenBLAS sgemm, each product of a Linear layer at
# M = 1, 16, 256, 4096 rows and in = out = 1024 and 4096, side by side in one run
# (tests/bench/gemm_bench.cc), then docs/perf/cpu-gemm-fp8.json (or $1) with the machine.
# Every copy of the micro-kernel this CPU runs is timed in the same run (GEMM_COPIES, default
# "all" minus the baseline: best first; "best" for the default copy alone).
#   scripts/bench-gemm.sh [OUT.json] [SECONDS per case, default 0.3]
set -euo pipefail
cd "$(dirname "$0")/.."
out_json=${1:-docs/perf/cpu-gemm-fp8.json}
secs=${2:-0.3}
./scripts/build.sh gemm_bench >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
copies=${GEMM_COPIES:-}
if [ -z "$copies" ]; then
  # every copy but the baseline (minutes at 4096 rows; only for CPUs with nothing better)
  copies=$(build/tests/gemm_bench --list-copies | grep -v '^baseline$' | paste -sd, -)
fi
build/tests/gemm_bench --seconds "$secs" --copies "$copies" --json "$tmp/gemm.json"
/usr/bin/python3 - "$tmp/gemm.json" "$out_json" <<'PY'
import json, sys
sys.path.insert(0, "scripts/lib")
from machine import describe
got = json.load(open(sys.argv[1]))
got = {"machine": describe(allocator="glibc", blas_name=got["blas"]), "command": "scripts/bench-gemm.sh",
       "what": "seconds per GEMM call, the fastest of repeated calls; fp8 from FP8 codes with the "
               "per-call decode (and wgrad's packing) inside the time, the weight's panels built "
               "once per weight version outside it; sgemm on ready fp32 operands, the faster of "
               "the pool split and OpenBLAS's own threads", **got}
json.dump(got, open(sys.argv[2], "w"), indent=2)
print(f"bench-gemm: wrote {sys.argv[2]}")
PY
