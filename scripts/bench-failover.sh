#!/usr/bin/env bash
# How fast a killed server's durable modules serve again behind the proxy: three gradwire-servers
# on one shared checkpoint directory (--checkpoint-shared, --checkpoint-every 2) behind HAProxy
# (deploy/haproxy/haproxy.cfg); tests/e2e/failover.py's kill phase, RUNS times on fresh servers.
# Each run: 24 modules trained 3 steps, one server killed (SIGKILL) while three clients train the
# other servers' modules; it records when HAProxy marked the server DOWN, when the first and the
# last of its modules answered again (taken over by the others, one call after another), the
# load's steps and errors by code. The table gives each run; the JSON records the machine.
#   scripts/bench-failover.sh [OUT.json] [RUNS, 3]
# Needs build/server/gradwire-server (scripts/build.sh gradwire-server) and haproxy
# (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out_json=${1:-/tmp/bench-failover.json}
runs=${2:-3}
command -v haproxy >/dev/null || { echo "bench-failover: haproxy not found (scripts/install-deps.sh)"; exit 1; }
server_bin=$root/build/server/gradwire-server
python=/usr/bin/python3
export PYTHONPATH="$root/client/python${PYTHONPATH:+:$PYTHONPATH}"
results=$(mktemp -d)
trap 'cleanup_more 2>/dev/null || true; rm -rf "$results"' EXIT
for run in $(seq 1 "$runs"); do
  tmp=$(mktemp -d -p "$results")
  server_flags=(--checkpoint-dir "$tmp/checkpoints" --checkpoint-shared --checkpoint-every 2)
  # shellcheck source=SCRIPTDIR/../tests/deploy/haproxy_lib.sh
  source "$root/tests/deploy/haproxy_lib.sh"
  start_cluster
  wait_states "gradwire-1=UP gradwire-2=UP gradwire-3=UP"
  "$python" "$root/tests/e2e/failover.py" kill "$proxy" "$admin" "${server_pids[2]}" \
    "$results/run$run.json" "$(cat "$tmp/port1")" "$(cat "$tmp/port2")" "$(cat "$tmp/port3")"
  cleanup_more || true
  echo "bench-failover: run $run of $runs done" >&2
done
"$python" - "$results" "$out_json" "$runs" <<'PY'
import glob, json, subprocess, sys
sys.path.insert(0, "scripts/lib")
from machine import commit as machine_commit, describe
results, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.load(open(f"{results}/run{i}.json"))["result"] for i in range(1, n + 1)]
print(f"{'run':>3} {'modules':>7} {'victims':>7} {'DOWN after kill s':>17} {'first served s':>14} "
      f"{'all served s':>12} {'load steps':>10} {'load errors':>11}")
for i, r in enumerate(rows, 1):
    print(f"{i:>3} {r['modules']:>7} {r['victims']:>7} {r['down_after_kill_s']:>17.3f} "
          f"{r['first_served_s']:>14.3f} {r['all_served_s']:>12.3f} {r['load_steps']:>10} "
          f"{str(r['load_errors'] or 0):>11}")
worst = max(r["all_served_s"] for r in rows)
print(f"worst: every module of the killed server served again {worst:.3f} s after DOWN "
      f"(target 2 s)")
haproxy = subprocess.run(["haproxy", "-v"], capture_output=True, text=True).stdout.split("\n")[0]
commit = machine_commit()
json.dump({"benchmark": "bench-failover", "machine": describe(), "commit": commit,
           "haproxy": haproxy, "checkpoint_every": 2, "servers": 3,
           "measured_from": "HAProxy's stats marking the killed server DOWN",
           "target_all_served_s": 2.0, "worst_all_served_s": worst, "runs": rows},
          open(out, "w"), indent=2)
print("bench-failover: wrote", out)
PY
