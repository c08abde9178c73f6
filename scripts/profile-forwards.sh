#!/usr/bin/env bash
# Where the CPU goes when 32 clients send 1-row forwards, next to the empty RPC on the same server:
# the CPU time per request, server and load tool, split by what runs it (the FP8 GEMM, the rest of
# gradwire, gRPC, protobuf, the C library, the kernel, ...). On a machine whose cores the load
# saturates, a forward's rate over the empty RPC's is about the inverse ratio of their CPU time
# per request, so the table says which part of a forward keeps it from the empty RPC's rate.
#
#   scripts/profile-forwards.sh [OUT_JSON, default docs/perf/forwards-profile.json] [SECONDS, 5]
#
# Needs perf (Debian's linux-perf) and the right to sample every CPU (root, or
# kernel.perf_event_paranoid <= 0). The server runs with its defaults (--device cpu only).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/perf/forwards-profile.json}
secs=${2:-5}
build_dir=${BUILD_DIR:-build}
server_bin="$build_dir/server/gradwire-server"
load_bin="$build_dir/client/gradwire-load"
[ -x "$server_bin" ] && [ -x "$load_bin" ] || { echo "build first (scripts/build.sh)" >&2; exit 1; }
command -v perf >/dev/null || { echo "profile-forwards: perf not found (apt-get install linux-perf)" >&2; exit 1; }
tmp=$(mktemp -d)
server_pid=
trap '[ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; rm -rf "$tmp"' EXIT

"$server_bin" --listen 127.0.0.1:0 --device cpu > "$tmp/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 200); do grep -q "listening on" "$tmp/server.log" && break; sleep 0.05; done
addr=$(grep -o "listening on [0-9.:]*" "$tmp/server.log" | awk '{print $3}')
[ -n "$addr" ] || { cat "$tmp/server.log"; exit 1; }

for flow in empty forward; do
  echo "== $flow: 32 clients, ${secs} s, perf sampling every CPU"
  "$load_bin" --server "$addr" --flow "$flow" --rows 1 -c 32 --warmup 1 --duration "$secs" \
    --json "$tmp/$flow.json" > "$tmp/$flow.txt" 2>&1 &
  load_pid=$!
  echo "$load_pid" > "$tmp/$flow.loadpid"
  sleep 1.2  # past the load tool's module creation and warm-up start
  perf record -a -F 997 -o "$tmp/$flow.data" -- sleep "$(awk -v s="$secs" 'BEGIN{print s - 0.5}')" \
    > "$tmp/$flow.perf.txt" 2>&1
  wait "$load_pid" || { cat "$tmp/$flow.txt"; exit 1; }
  perf script -i "$tmp/$flow.data" -F comm,pid,ip,sym,dso 2> /dev/null > "$tmp/$flow.samples"
done

/usr/bin/python3 scripts/lib/profile_classes.py "$tmp" "$server_pid" "$secs" "$out"
