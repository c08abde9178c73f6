#!/usr/bin/env bash
# Dynamic batching (docs/batching.md), measured side by side on one machine; the JSON records it
# (scripts/lib/machine.py).
#   scripts/bench-batch.sh [OUT_JSON, default docs/perf/batching.json] [seconds per run, default 5]
# 1. Throughput: Linear 1024->1024 inference forwards of 1 row from 32 concurrent clients
#    (gradwire-load -c 32), against the default server (the FP8 GEMM, batching on, no delay), the
#    same with batching off (--max-batch-rows 0), with a 500 us batch delay, and on BLAS
#    (--cpu-gemm blas, with and without batching: the earlier default was BLAS without), and the
#    empty-RPC rate of the same server (the ceiling of any forward rate). Then a single client
#    (-c 1) on the default server and with batching off: what batching costs a client alone.
# 2. Training steps: the same Linear, 1-row training forwards each followed by its backward, from
#    32 clients (gradwire-load --flow step), default and batching off (forwards and backwards
#    batch).
# 3. Fairness: two tenants of equal weight on one server, each with its own module; the light
#    tenant (1 request in flight) alone, then next to the heavy one (32 in flight): its p99 both
#    times; with batching on, on with --batch-yield true (batches yield to other clients' work),
#    and off; then on and off again with the heavy tenant's load tool at nice 19 (its client
#    threads then leave the two cores to the server and the light client). Last, the floor: the
#    heavy tenant sends empty RPCs (GetServerInfo, which never reaches the executor) at the rate its
#    forwards reached with batching on (open loop, up to 32 in flight), at nice 0 and 19: what
#    gRPC's threads and the operating system alone do to the light tenant's p99 at that call rate,
#    whatever the executor's scheduling.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/perf/batching.json}
secs=${2:-5}
build_dir=${BUILD_DIR:-build}
server_bin="$build_dir/server/gradwire-server"
load_bin="$build_dir/client/gradwire-load"
[ -x "$server_bin" ] && [ -x "$load_bin" ] || { echo "build first (scripts/build.sh)" >&2; exit 1; }
tmp=$(mktemp -d)
server_pid=
stop_server() { [ -n "$server_pid" ] && { kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; }; server_pid=; }
trap 'stop_server; rm -rf "$tmp"' EXIT

start_server() {  # flags...
  "$server_bin" --listen 127.0.0.1:0 --device cpu "$@" > "$tmp/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 200); do grep -q "listening on" "$tmp/server.log" && break; sleep 0.05; done
  addr=$(grep -o "listening on [0-9.:]*" "$tmp/server.log" | awk '{print $3}')
  [ -n "$addr" ] || { cat "$tmp/server.log"; exit 1; }
}

load() {  # name, flags...
  local name=$1; shift
  "$load_bin" --server "$addr" --duration "$secs" --warmup 1 --json "$tmp/$name.json" "$@" \
    > "$tmp/$name.txt" 2>&1 || { cat "$tmp/$name.txt"; exit 1; }
  grep -A1 "^mode" "$tmp/$name.txt" | tail -1 | sed "s/^/  $name: /"
}

echo "== throughput: Linear 1024->1024, 1 row, 32 clients, ${secs} s each"
configs=(
  "default|"
  "off|--max-batch-rows 0"
  "default-delay500|--batch-delay-us 500"
  "blas-off|--cpu-gemm blas --max-batch-rows 0"
  "blas-on|--cpu-gemm blas"
)
for c in "${configs[@]}"; do
  name=${c%%|*}; flags=${c#*|}
  # shellcheck disable=SC2086
  start_server $flags
  load "$name" --flow forward --rows 1 -c 32
  case "$name" in
    default) load "empty-rpc" --flow empty -c 32; load "single-default" --flow forward --rows 1 -c 1 ;;
    off) load "single-off" --flow forward --rows 1 -c 1 ;;
  esac
  stop_server
done

echo "== training steps: Linear 1024->1024, 1 row, 32 clients (a forward and its backward each)"
for c in "step-off|--max-batch-rows 0" "step-default|"; do
  name=${c%%|*}; flags=${c#*|}
  # shellcheck disable=SC2086
  start_server $flags
  load "$name" --flow step --rows 1 -c 32
  stop_server
done

echo "== fairness: light tenant (1 in flight) alone, then beside a heavy one (32 in flight)"
rate_of() {  # a load tool JSON: its run's requests/s, rounded
  python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["runs"][0]["requests_per_s"]))' "$1"
}
printf 'heavy heavy-token-0123456789abcdef\nlight light-token-0123456789abcdef\n' > "$tmp/tokens"
printf 'heavy-token-0123456789abcdef\n' > "$tmp/heavy.token"
printf 'light-token-0123456789abcdef\n' > "$tmp/light.token"
for mode in on on-yield off on-nice off-nice floor floor-nice; do
  flags="--tokens-file $tmp/tokens"
  case "$mode" in
    on-yield) flags="$flags --batch-yield true" ;;
    off | off-nice) flags="$flags --max-batch-rows 0" ;;
  esac
  # *-nice: the heavy tenant's load tool at the lowest CPU priority, so that its own 32 client
  # threads take (almost) no CPU from the server and the light client: what is left of the light
  # tenant's tail is the server's doing.
  heavy_nice=0
  case "$mode" in *-nice) heavy_nice=19 ;; esac
  heavy_flow=(--flow forward)
  case "$mode" in
    floor) heavy_flow=(--flow empty --rate "$(rate_of "$tmp/heavy-on.json")") ;;
    floor-nice) heavy_flow=(--flow empty --rate "$(rate_of "$tmp/heavy-on-nice.json")") ;;
  esac
  # shellcheck disable=SC2086
  start_server $flags
  load "light-alone-$mode" --token-file "$tmp/light.token" --flow forward --rows 1 -c 1
  nice -n "$heavy_nice" "$load_bin" --server "$addr" --token-file "$tmp/heavy.token" \
    "${heavy_flow[@]}" --rows 1 -c 32 --duration "$((secs + 3))" --warmup 0 \
    --json "$tmp/heavy-$mode.json" > "$tmp/heavy-$mode.txt" 2>&1 &
  heavy=$!
  sleep 1.5
  load "light-beside-heavy-$mode" --token-file "$tmp/light.token" --flow forward --rows 1 -c 1
  wait $heavy || { cat "$tmp/heavy-$mode.txt"; exit 1; }
  grep -A1 "^mode" "$tmp/heavy-$mode.txt" | tail -1 | sed "s/^/  heavy-$mode: /"
  stop_server
done

python3 - "$tmp" "$out" "$secs" <<'PY'
import json, os, sys
sys.path.insert(0, "scripts/lib")
import machine
tmp, out, secs = sys.argv[1:]
def run(name):
    j = json.load(open(os.path.join(tmp, name + ".json")))
    r = [x for x in j["runs"] if x["mode"] in ("remote", "empty-rpc")][0]
    return {"requests_per_s": r["requests_per_s"], "p50_ms": r["latency"]["p50_ms"],
            "p99_ms": r["latency"]["p99_ms"], "codes": r["codes"],
            "batch_requests": r.get("batch_requests")}
names = ["default", "off", "default-delay500", "blas-off", "blas-on", "empty-rpc",
         "single-default", "single-off"]
tp = {n: run(n) for n in names}
def ratio(a, b, key="requests_per_s"):
    return tp[a][key] / tp[b][key] if tp[b][key] else None
steps = {n: run(n) for n in ["step-off", "step-default"]}
fair = {m: {"light_alone": run(f"light-alone-{m}"), "light_beside_heavy": run(f"light-beside-heavy-{m}"),
            "heavy": run(f"heavy-{m}")}
        for m in ("on", "on-yield", "off", "on-nice", "off-nice", "floor", "floor-nice")}
for m, f in fair.items():
    f["light_p99_ratio"] = f["light_beside_heavy"]["p99_ms"] / f["light_alone"]["p99_ms"]
result = {
    "benchmark": "dynamic batching: Linear 1024->1024, 1-row inference forwards; 'default' is "
                 "the server with no flags (FP8 GEMM, --max-batch-rows 256, no delay)",
    "command": f"scripts/bench-batch.sh {out} {secs}",
    "machine": machine.describe(),
    "throughput_32_clients": tp,
    "ratios": {
        "rate_default_vs_blas_off (the earlier default)": ratio("default", "blas-off"),
        "rate_default_vs_batching_off": ratio("default", "off"),
        "rate_blas_on_vs_blas_off": ratio("blas-on", "blas-off"),
        "p99_default_vs_blas_off": ratio("default", "blas-off", "p99_ms"),
        "p99_default_vs_batching_off": ratio("default", "off", "p99_ms"),
        "rate_default_vs_empty_rpc": ratio("default", "empty-rpc"),
        "single_client_p50_default_vs_batching_off": ratio("single-default", "single-off", "p50_ms"),
    },
    "training_steps_32_clients": steps,
    "steps_default_vs_batching_off": {
        "rate": steps["step-default"]["requests_per_s"] / steps["step-off"]["requests_per_s"],
        "p99": steps["step-default"]["p99_ms"] / steps["step-off"]["p99_ms"],
    },
    "fairness_equal_weights": fair,
    # floor*: the heavy tenant's calls are empty RPCs that never reach the executor, so these
    # ratios are what no scheduling of the device can go below on this machine.
    "fairness_floor_note": ("floor and floor-nice: the heavy tenant sends empty RPCs (GetServerInfo) "
                            "at the rate of its forwards in 'on' and 'on-nice', open loop"),
}
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
json.dump(result, open(out, "w"), indent=2)
print("\nratios:", json.dumps(result["ratios"], indent=1))
print("training steps, default (batching on) vs batching off:",
      json.dumps(result["steps_default_vs_batching_off"]))
for m, f in fair.items():
    print(f"fairness, batching {m}: light p99 alone {f['light_alone']['p99_ms']:.3f} ms, "
          f"beside heavy {f['light_beside_heavy']['p99_ms']:.3f} ms: x{f['light_p99_ratio']:.2f}")
for m in ("on", "off"):
    for suffix in ("", "-nice"):
        f, floor = fair[m + suffix], fair["floor" + suffix]
        print(f"batching {m}{suffix}: light p99 ratio x{f['light_p99_ratio']:.2f} against the "
              f"floor's x{floor['light_p99_ratio']:.2f} (heavy sending empty RPCs)")
print(f"wrote {out}")
PY
