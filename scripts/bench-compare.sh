#!/usr/bin/env bash
# Two builds of gradwire side by side in one run on one machine: for the cases of
# scripts/bench-cpu.sh (Linear 1024->1024 at 16, 256 and 4096 rows; LayerNormMLP 1024/4096 at 256
# rows), each tree's gradwire-load runs training steps against that tree's gradwire-server
# (remote) and in its own process (in-process), the two trees taking turns case by case in the
# order before, after, after, before (so neither always runs first), and the table gives
# after / before for both. For a change that must not make the CPU paths slower.
#   scripts/bench-compare.sh BEFORE_ROOT AFTER_ROOT [OUT.json] [SECONDS per case and mode, 5]
# Each root is a source tree with build/server/gradwire-server and build/client/gradwire-load
# built (scripts/build.sh gradwire-server gradwire-load there).
set -euo pipefail
cd "$(dirname "$0")/.."
before=$(cd "$1" && pwd)
after=$(cd "$2" && pwd)
out_json=${3:-/tmp/bench-compare.json}
secs=${4:-5}
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$tmp"' EXIT
start_server() {  # start_server NAME ROOT: its address in $tmp/NAME.addr
  "$2/build/server/gradwire-server" --listen 127.0.0.1:0 --device cpu > "$tmp/$1.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do grep -q "listening on" "$tmp/$1.log" && break; sleep 0.1; done
  grep -o "listening on [0-9.:]*" "$tmp/$1.log" | awk '{print $3}' > "$tmp/$1.addr"
}
start_server before "$before"
start_server after "$after"
cases="linear:1024:1024:0:16 linear:1024:1024:0:256 linear:1024:1024:0:4096 mlp:1024:1024:4096:256"
for c in $cases; do
  IFS=: read -r kind in outf ffn rows <<< "$c"
  module=(--kind linear); [ "$kind" = mlp ] && module=(--kind layernorm-mlp --ffn "$ffn")
  pass=0
  for tree in before after after before; do
    pass=$((pass + 1))
    root=$before; [ "$tree" = after ] && root=$after
    "$root/build/client/gradwire-load" --server "$(cat "$tmp/$tree.addr")" "${module[@]}" \
      --in "$in" --out "$outf" --rows "$rows" --flow step --warmup 1 --duration "$secs" \
      --baselines --json "$tmp/$tree-$kind-$rows-$pass.json" > "$tmp/$tree.txt" 2>&1 ||
      { cat "$tmp/$tree.txt"; exit 1; }
  done
  echo "bench-compare: $kind rows $rows done"
done
/usr/bin/python3 - "$tmp" "$out_json" "$cases" "$before" "$after" <<'PY'
import json, subprocess, sys
sys.path.insert(0, "scripts/lib")
from machine import describe
tmp, out, cases, before, after = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4], sys.argv[5]
def commit(root):
    return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
def rates(pattern):
    import glob
    runs = [x for path in glob.glob(pattern) for x in json.load(open(path))["runs"]]
    modes = {x["mode"] for x in runs}
    remote = "remote-shm" if "remote-shm" in modes else "remote"
    return {m: sum(x["requests"] for x in runs if x["mode"] == src) /
               sum(x["seconds"] for x in runs if x["mode"] == src)
            for m, src in (("remote", remote), ("in-process", "in-process"))}
rows = []
print(f"{'case':<26} {'remote before':>13} {'after':>8} {'ratio':>6} | "
      f"{'in-proc before':>14} {'after':>8} {'ratio':>6}")
for c in cases:
    kind, d_in, d_out, ffn, r = c.split(":")
    b, a = rates(f"{tmp}/before-{kind}-{r}-*.json"), rates(f"{tmp}/after-{kind}-{r}-*.json")
    row = {"kind": kind, "in": int(d_in), "out": int(d_out), "ffn": int(ffn), "rows": int(r),
           "before_remote_steps_per_s": b["remote"], "after_remote_steps_per_s": a["remote"],
           "before_inprocess_steps_per_s": b["in-process"],
           "after_inprocess_steps_per_s": a["in-process"],
           "remote_after_vs_before": a["remote"] / b["remote"],
           "inprocess_after_vs_before": a["in-process"] / b["in-process"]}
    rows.append(row)
    name = f"{kind} {d_in}->{d_out}" + (f"/{ffn}" if kind == "mlp" else "") + f" x{r}"
    print(f"{name:<26} {b['remote']:13.2f} {a['remote']:8.2f} {row['remote_after_vs_before']:6.2f} | "
          f"{b['in-process']:14.2f} {a['in-process']:8.2f} {row['inprocess_after_vs_before']:6.2f}")
json.dump({"benchmark": "bench-compare", "before": commit(before), "after": commit(after),
           "units": "training steps per second; ratio = after / before",
           "machine": describe(), "cases": rows}, open(out, "w"), indent=1)
print(f"wrote {out}")
PY
