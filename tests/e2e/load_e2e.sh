#!/usr/bin/env bash
# gradwire-load against a real server: short closed-loop, open-loop and sweep runs; checks the
# JSON and CSV reports and the plot.
#   usage: load_e2e.sh PATH/gradwire-server PATH/gradwire-load
set -euo pipefail
server_bin=$1
load_bin=$2
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$(dirname "$0")/../../scripts/lib/check.sh"

start_server --listen 127.0.0.1:0
common=(--server "$addr" --in 64 --out 32 --rows 8 --warmup 0.2)

"$load_bin" "${common[@]}" --flow step --count 40 --baselines --json "$tmp/step.json" \
  --csv "$tmp/step.csv" >"$tmp/step.out" 2>"$tmp/step.err"
check "step: prints the table" grep -q "^remote " "$tmp/step.out"
check "step: progress on stderr" grep -q "remote c=1" "$tmp/step.err"
check "step: JSON has every field" /usr/bin/python3 - "$tmp/step.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["flow"] == "step" and r["rows"] == 8 and r["in_features"] == 64, r
modes = {x["mode"]: x for x in r["runs"]}
assert set(modes) == {"remote", "in-process", "empty-rpc"}, modes.keys()
remote = modes["remote"]
assert remote["requests"] == 40 and remote["ok"] == 40 and remote["codes"] == {"OK": 40}, remote
for stage in ("latency", "forward", "backward"):
    s = remote[stage]
    assert s["count"] == 40, (stage, s)
    assert 0 < s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"] <= s["p999_ms"] <= s["max_ms"], (stage, s)
assert remote["requests_per_s"] > 0 and remote["payload_bytes_per_s"] > 0
# The exact wire (the default): the Linear's input 8x64 as E4M3 codes, 1 byte each; its output
# 8x32, then grad_output 8x32 and grad_input 8x64 as f32, 4 bytes each.
assert r["wire_dtype"] == "exact", r["wire_dtype"]
step_bytes = 8 * 64 + 4 * 8 * (32 + 32 + 64)
assert abs(remote["payload_bytes_per_s"] / remote["requests_per_s"] - step_bytes) < 1e-6 * remote["payload_bytes_per_s"], remote
assert remote["server_compute_ms_mean"] > 0
assert modes["in-process"]["ok"] == 40 and modes["empty-rpc"]["ok"] == 40
ratio = r["ratios"][0]
assert ratio["p50_latency_vs_in_process"] > 0 and ratio["rate_vs_empty_rpc"] > 0, ratio
assert r["server_view"]["live_contexts"] == 0, r["server_view"]  # every step's context consumed
PY
check "step: CSV has a header and three runs" bash -c "[ \$(wc -l <'$tmp/step.csv') = 4 ] && head -1 '$tmp/step.csv' | grep -q '^mode,concurrency,rate'"

"$load_bin" "${common[@]}" --flow forward --rate 200 --arrivals poisson --duration 1 \
  --concurrency 4 --json "$tmp/open.json" >/dev/null 2>&1
check "open loop: about rate x duration requests, latency from intended send" /usr/bin/python3 - "$tmp/open.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
run = r["runs"][0]
assert r["arrivals"] == "poisson" and run["rate"] == 200, r
assert 120 <= run["requests"] <= 300, run["requests"]
assert "max_send_lag_ms" in run and run["ok"] == run["requests"], run
PY

"$load_bin" "${common[@]}" --flow forward --duration 0.5 --sweep 1,2,4 --plot "$tmp/sweep.png" \
  --json "$tmp/sweep.json" >/dev/null 2>&1
check "sweep: one run per concurrency" /usr/bin/python3 -c "
import json; r = json.load(open('$tmp/sweep.json'))
assert [x['concurrency'] for x in r['runs']] == [1, 2, 4], r['runs']"
check "sweep: the plot is a PNG" bash -c "head -c 8 '$tmp/sweep.png' | grep -q PNG"

"$load_bin" "${common[@]}" --flow stream --count 30 --concurrency 2 --baselines \
  --json "$tmp/stream.json" >/dev/null 2>&1
check "stream: steps on Train streams, every context consumed" /usr/bin/python3 - "$tmp/stream.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
modes = {x["mode"]: x for x in r["runs"]}
remote = modes["remote"]
assert r["flow"] == "stream" and remote["ok"] == 30 and remote["codes"] == {"OK": 30}, remote
assert remote["forward"]["count"] == 30 and remote["backward"]["count"] == 30, remote
assert modes["in-process"]["ok"] == 30, modes["in-process"]
assert r["server_view"]["live_contexts"] == 0, r["server_view"]
PY
set +e
"$load_bin" --server "$addr" --module 0123456789abcdef0123456789abcdef >"$tmp/nomod.out" 2>&1
rc2=$?
set -e
check "unknown module: a clear error" bash -c "[ $rc2 = 1 ] && grep -q 'is not on' '$tmp/nomod.out'"
check "the created modules are deleted" bash -c "'$load_bin' --server '$addr' --flow empty --count 5 --json - 2>/dev/null | grep -q '\"modules\": 0'"
stop_server
finish
