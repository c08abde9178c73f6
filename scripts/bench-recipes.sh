#!/usr/bin/env bash
# Training steps/s of each FP8 recipe on the CPU backend, side by side in one run: Linear 1024^2
# and LayerNormMLP 1024/4096 at 256 and 4096 rows, remote through gradwire-load on loopback (one
# server, one client, the defaults otherwise). The recipes of a case run in interleaved rounds
# (current, block, mxfp8, current, ...) so that a busy machine's noise falls on all of them; each
# recipe's rate is its steps over its seconds, all rounds together. Prints a table of steps/s and
# each block recipe's step time against CURRENT's, and writes docs/perf/recipes-cpu.json (or $1)
# with the machine (docs/block-scaling.md, "Speed").
#   scripts/bench-recipes.sh [OUT.json] [SECONDS per run, default 4] [ROUNDS, default 3]
# BENCH_CASES="linear:256 mlp:4096 ..." runs fewer cases.
set -euo pipefail
cd "$(dirname "$0")/.."
out_json=${1:-docs/perf/recipes-cpu.json}
secs=${2:-4}
rounds=${3:-3}
cases=${BENCH_CASES:-"linear:256 linear:4096 mlp:256 mlp:4096"}
recipes="current block mxfp8"
for bin in build/server/gradwire-server build/client/gradwire-load; do
  [ -x "$bin" ] || { echo "bench-recipes: no $bin (./scripts/build.sh gradwire-server gradwire-load)" >&2; exit 1; }
done
tmp=$(mktemp -d)
server_pid=
trap '[ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; rm -rf "$tmp"' EXIT
build/server/gradwire-server --listen 127.0.0.1:0 --device cpu >"$tmp/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do grep -q "listening on" "$tmp/server.log" && break; sleep 0.1; done
addr=$(grep -o "listening on [0-9.:]*" "$tmp/server.log" | awk '{print $3}')
[ -n "$addr" ] || { cat "$tmp/server.log" >&2; exit 1; }
echo "bench-recipes: server at $addr; $rounds rounds of $secs s per recipe and case"
for c in $cases; do
  IFS=: read -r kind rows <<<"$c"
  module=(--kind linear --in 1024 --out 1024)
  [ "$kind" = mlp ] && module=(--kind layernorm-mlp --in 1024 --out 1024 --ffn 4096)
  for round in $(seq "$rounds"); do
    for r in $recipes; do
      json="$tmp/$kind-$rows-$r-$round.json"
      build/client/gradwire-load --server "$addr" "${module[@]}" --rows "$rows" --flow step \
        --recipe "$r" --warmup 1 --duration "$secs" --json "$json" >"$tmp/run.txt" 2>&1 ||
        { cat "$tmp/run.txt" >&2; exit 1; }
    done
  done
  echo "bench-recipes: $kind x$rows done"
done
backend=$(grep -o "on cpu: .*" "$tmp/server.log" | head -1 | cut -c9-)
/usr/bin/python3 - "$tmp" "$out_json" "$cases" "$recipes" "$rounds" "$secs" "$backend" <<'PY'
import glob, json, os, sys
sys.path.insert(0, "scripts/lib")
from machine import describe
tmp, out, cases, recipes, rounds, secs, backend = sys.argv[1:8]
cases, recipes = cases.split(), recipes.split()
rows = []
print(f"{'case':<26}" + "".join(f"{r:>10}" for r in recipes) +
      "".join(f"{r + '/cur':>12}" for r in recipes[1:]) + "   (steps/s; step time vs CURRENT)")
for c in cases:
    kind, r = c.split(":")
    rate = {}
    for recipe in recipes:
        steps = seconds = 0.0
        for path in glob.glob(f"{tmp}/{kind}-{r}-{recipe}-*.json"):
            for run in json.load(open(path))["runs"]:
                if run["mode"].startswith("remote"):
                    steps += run["requests"]
                    seconds += run["seconds"]
        rate[recipe] = steps / seconds if seconds else float("nan")
    row = {"kind": "linear" if kind == "linear" else "layernorm-mlp", "in": 1024, "out": 1024,
           "ffn": 4096 if kind == "mlp" else 0, "rows": int(r),
           "steps_per_s": rate,
           "step_time_vs_current": {x: rate["current"] / rate[x] for x in recipes[1:]}}
    rows.append(row)
    name = ("Linear 1024x1024" if kind == "linear" else "LayerNormMLP 1024/4096") + f" x{r}"
    print(f"{name:<26}" + "".join(f"{rate[x]:10.2f}" for x in recipes) +
          "".join(f"{row['step_time_vs_current'][x]:12.2f}" for x in recipes[1:]))
doc = {"benchmark": "scripts/bench-recipes.sh",
       "what": "training steps/s per FP8 recipe, CPU backend, remote on loopback (gradwire-load "
               "--flow step, one client), recipes interleaved in rounds",
       "rounds": int(rounds), "seconds_per_run": float(secs),
       "load_average": os.getloadavg(),
       "machine": describe(server=backend), "cases": rows}
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
print(f"bench-recipes: wrote {out}")
PY
