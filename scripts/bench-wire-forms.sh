#!/usr/bin/env bash
# The wire forms side by side (docs/wire.md, docs/performance.md): training steps/s of a remote
# Linear 1024->1024 on loopback (gradwire-load --flow step, one client, the load tool's defaults
# otherwise: shared memory when a step's tensors reach 64 KiB) with --wire-dtype f32, fp8 and
# exact at 16, 256 and 4096 rows, and the 16-row forward alone, in one run. Every case of every
# round runs once per form and tree, interleaved, so that a noisy machine treats them alike.
#   scripts/bench-wire-forms.sh [OUT.json] [SECONDS per case and round, default 4] [ROUNDS, default 2]
# BENCH_TREES: source trees to compare, each with build/server/gradwire-server and
# build/client/gradwire-load, as LABEL=PATH or PATH (default: this one), e.g.
# BENCH_TREES="before=../main after=." for before/after. A tree's load tool that lacks a form (no
# "exact" before it existed) skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
out_json=${1:-docs/perf/wire-forms.json}
secs=${2:-4}
rounds=${3:-2}
read -r -a specs <<< "${BENCH_TREES:-.}"
trees=() labels=()
for t in "${specs[@]}"; do
  if [[ $t == *=* ]]; then labels+=("${t%%=*}") trees+=("${t#*=}"); else labels+=("$t") trees+=("$t"); fi
done
tmp=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
addrs=()
for i in "${!trees[@]}"; do
  "${trees[$i]}/build/server/gradwire-server" --listen 127.0.0.1:0 --device cpu \
    > "$tmp/server-$i.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do grep -qs "listening on" "$tmp/server-$i.log" && break; sleep 0.1; done
  addrs+=("$(grep -o "listening on [0-9.:]*" "$tmp/server-$i.log" | awk '{print $3}')")
  echo "bench-wire-forms: ${trees[$i]}: server at ${addrs[$i]}"
done
cases="step:16 step:256 step:4096 forward:16"
for round in $(seq "$rounds"); do
  for c in $cases; do
    IFS=: read -r flow rows <<< "$c"
    for i in "${!trees[@]}"; do
      for form in f32 fp8 exact; do
        load="${trees[$i]}/build/client/gradwire-load"
        if ! "$load" --help 2>/dev/null | grep -o "wire-dtype TEXT:{[^}]*}" | grep -qw "$form"; then
          continue
        fi
        json="$tmp/$i-$flow-$rows-$form-$round.json"
        "$load" --server "${addrs[$i]}" --kind linear --in 1024 --out 1024 --rows "$rows" \
          --flow "$flow" --wire-dtype "$form" --warmup 1 --duration "$secs" --json "$json" \
          > "$tmp/load.txt" 2>&1 || { cat "$tmp/load.txt"; exit 1; }
      done
    done
    echo "bench-wire-forms: round $round $flow $rows rows done"
  done
done
/usr/bin/python3 - "$tmp" "$out_json" "$cases" "$rounds" "${#trees[@]}" "${trees[@]}" "${labels[@]}" <<'PY'
import glob, json, os, subprocess, sys
sys.path.insert(0, "scripts/lib")
from machine import describe
tmp, out, cases, rounds = sys.argv[1], sys.argv[2], sys.argv[3].split(), int(sys.argv[4])
n_trees = int(sys.argv[5])
trees, labels = sys.argv[6:6 + n_trees], sys.argv[6 + n_trees:]
forms = ["f32", "fp8", "exact"]

def commit(tree):
    """The tree's HEAD, "+" when it has changes not committed (its binaries may be older still)."""
    try:
        head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               check=True, capture_output=True, text=True).stdout.strip()
        return head + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None

rows_out = []
for i, tree in enumerate(trees):
    for c in cases:
        flow, r = c.split(":")
        row = {"tree": labels[i], "path": tree, "commit": commit(tree), "flow": flow,
               "rows": int(r)}
        for form in forms:
            runs = []
            for f in sorted(glob.glob(f"{tmp}/{i}-{flow}-{r}-{form}-*.json")):
                runs += [x for x in json.load(open(f))["runs"] if x["mode"].startswith("remote")]
            if not runs:
                continue
            n = sum(x["requests"] for x in runs)
            s = sum(x["seconds"] for x in runs)
            if not n:  # too short a run for one request
                continue
            row[form] = {"per_s": n / s, "path": sorted({x["mode"] for x in runs}),
                         "payload_bytes_per_step": sum(x["payload_bytes_per_s"] * x["seconds"]
                                                       for x in runs) / n,
                         "server_ms_mean": sum(x["server_compute_ms_mean"] * x["requests"]
                                               for x in runs) / n,
                         "p50_ms": sorted(x["latency"]["p50_ms"] for x in runs)[len(runs) // 2]}
        rows_out.append(row)
unit = {"step": "steps/s", "forward": "forwards/s"}
print(f"{'tree':<14} {'case':<14} " + " ".join(f"{f:>16}" for f in forms) +
      f" {'fp8/f32':>8} {'exact/f32':>9}")
for row in rows_out:
    cells = []
    for f in forms:
        v = row.get(f)
        cells.append(f"{v['per_s']:9.1f} {'shm' if v['path'] == ['remote-shm'] else 'gRPC':>6}"
                     if v else f"{'-':>16}")
    ratio = lambda f: (f"{row[f]['per_s'] / row['f32']['per_s']:.2f}" if f in row and "f32" in row
                       else "-")
    name = f"{row['flow']} x{row['rows']}"
    print(f"{row['tree']:<14} {name:<14} " + " ".join(cells) +
          f" {ratio('fp8'):>8} {ratio('exact'):>9}")
backend = ""
log = os.path.join(tmp, f"server-{len(trees) - 1}.log")
for line in open(log):
    if "on cpu: " in line:
        backend = line.split("on cpu: ", 1)[1].strip()
        break
json.dump({"machine": describe(server=backend), "command": "scripts/bench-wire-forms.sh",
           "module": "Linear 1024 -> 1024, bias, CURRENT", "rounds": rounds,
           "unit": "remote training steps (forward + backward) or forwards per second, one client",
           "cases": rows_out}, open(out, "w"), indent=2)
print(f"bench-wire-forms: wrote {out}")
PY
