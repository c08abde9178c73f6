#!/usr/bin/env bash
# An in-process training step next to its GEMMs (tests/bench/step_breakdown.cc) on the CPU
# backend, with the forward and input-gradient GEMMs on BLAS and then on the row-invariant kernel
# (--cpu-gemm ordered), one after the other on one machine; each JSON records the machine
# (scripts/lib/machine.py).
#   scripts/bench-step.sh [OUT_DIR, default docs/perf] [seconds per row count, default 2] [fp8]
# writes OUT_DIR/step-breakdown.json (BLAS, rows 16,256,4096), OUT_DIR/cpu-gemm.json (both
# settings, rows 1,16,256,4096) and OUT_DIR/step-fp8-gemm.json (the server's defaults, the FP8
# GEMM and the BLOCK recipe, then the per-tensor current recipe; rows 16,256,4096). With a third
# argument "fp8", only the last.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/ccache.sh
source scripts/lib/ccache.sh
out_dir=${1:-docs/perf}
secs=${2:-2}
only=${3:-}
build_dir=${BUILD_DIR:-build}
cmake --build "$build_dir" -j "${JOBS:-2}" --target step_breakdown
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bench="$build_dir/tests/step_breakdown --seconds $secs"
for recipe in block current; do
  echo "== --cpu-gemm ordered --recipe $recipe, rows 16,256,4096"
  $bench --cpu-gemm ordered --recipe "$recipe" --rows 16,256,4096 --json "$tmp/fp8-$recipe.json"
done
if [[ "$only" != fp8 ]]; then
  echo "== --cpu-gemm blas, rows 16,256,4096"
  $bench --cpu-gemm blas --rows 16,256,4096 --json "$tmp/step.json"
  for gemm in blas ordered; do
    echo "== --cpu-gemm $gemm, rows 1,16,256,4096"
    $bench --cpu-gemm "$gemm" --rows 1,16,256,4096 --json "$tmp/$gemm.json"
  done
fi
python3 - "$tmp" "$out_dir" "$secs" "$only" <<'PY'
import json, os, sys
sys.path.insert(0, "scripts/lib")
import machine
tmp, out_dir, secs, only = sys.argv[1:]
desc = machine.describe()
suffix = " fp8" if only == "fp8" else ""
fp8 = {"benchmark": "step_breakdown, --cpu-gemm ordered, recipes block then current",
       "command": f"scripts/bench-step.sh {out_dir} {secs}{suffix}", "machine": desc,
       "runs": [json.load(open(os.path.join(tmp, f"fp8-{r}.json"))) for r in ("block", "current")]}
json.dump(fp8, open(os.path.join(out_dir, "step-fp8-gemm.json"), "w"), indent=2)
if only == "fp8":
    print(f"wrote {out_dir}/step-fp8-gemm.json")
    sys.exit(0)
step = json.load(open(os.path.join(tmp, "step.json")))
step["machine"] = desc
step["command"] = f"scripts/bench-step.sh {out_dir} {secs}"
json.dump(step, open(os.path.join(out_dir, "step-breakdown.json"), "w"), indent=2)
both = {"benchmark": "step_breakdown, --cpu-gemm blas then ordered",
        "command": f"scripts/bench-step.sh {out_dir} {secs}", "machine": desc,
        "runs": [json.load(open(os.path.join(tmp, g + ".json"))) for g in ("blas", "ordered")]}
json.dump(both, open(os.path.join(out_dir, "cpu-gemm.json"), "w"), indent=2)
print(f"wrote {out_dir}/step-breakdown.json, {out_dir}/cpu-gemm.json and {out_dir}/step-fp8-gemm.json")
PY
