#!/usr/bin/env bash
# One outlier against each FP8 recipe (docs/block-scaling.md): a Linear 256 -> 128, 32 rows, one
# element of 3e6 in row 0; the worst relative error of rows 1..31 against the float64 product of
# the unquantized input and weights, clean, on the outlier's step and on the two clean steps
# after it, for CURRENT, DELAYED, BLOCK and MXFP8 (tests/bench/outlier_bench.cc, CPU backend, in
# process). Writes docs/perf/outlier.json (or $1) with the machine.
#   scripts/bench-outlier.sh [OUT.json] [SEED, default 7]
set -euo pipefail
cd "$(dirname "$0")/.."
out_json=${1:-docs/perf/outlier.json}
seed=${2:-7}
./scripts/build.sh outlier_bench >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
build/tests/outlier_bench --seed "$seed" --json "$tmp/outlier.json"
/usr/bin/python3 - "$tmp/outlier.json" "$out_json" <<'PY'
import json, sys
sys.path.insert(0, "scripts/lib")
from machine import describe
got = json.load(open(sys.argv[1]))
got = {"machine": describe(allocator="glibc"), "command": "scripts/bench-outlier.sh",
       "what": "worst relative error of rows 1..31 (per row: max |y - ref| / max |ref|) of a "
               "Linear 256 -> 128 training forward on the CPU backend, against the float64 "
               "product of the unquantized input and weights plus the bias; clean: a clean batch "
               "after three clean steps; outlier: the same batch with 3e6 in row 0; after_1, "
               "after_2: the two clean batches that follow", **got}
json.dump(got, open(sys.argv[2], "w"), indent=2)
print(f"bench-outlier: wrote {sys.argv[2]}")
PY
