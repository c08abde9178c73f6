#!/usr/bin/env bash
# End to end with the real binaries: start gradwire-server on a free loopback port, run the CLI
# against it (info, demo), check the demo's loss falls, stop the server with SIGTERM and check it
# exits cleanly. Also checks the server's and CLI's answers to bad flags and unreachable servers.
#   usage: cli_e2e.sh PATH/gradwire-server PATH/gradwire PATH/gradwire-load
set -euo pipefail
server_bin=$1
cli_bin=$2
load_bin=$3
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$(dirname "$0")/../../scripts/lib/check.sh"

start_server --listen 127.0.0.1:0
echo "server at $addr"
check "server binds loopback" grep -q "listening on 127.0.0.1:" "$tmp/server.log"

"$cli_bin" info --server "$addr" >"$tmp/info.txt"
check "info names the device" grep -q '^device *cpu' "$tmp/info.txt"

"$cli_bin" demo --server "$addr" --steps 200 --json >"$tmp/demo.json" 2>"$tmp/demo.err"
cat "$tmp/demo.json"
json_field() { grep -o "\"$1\":[-0-9.eE+]*" "$tmp/demo.json" | cut -d: -f2; }
initial=$(json_field initial_loss)
final=$(json_field final_loss)
steps=$(json_field steps)
check "demo ran 200 steps" [ "$steps" = 200 ]
check "demo loss fell by well over half ($initial -> $final)" \
  awk -v i="$initial" -v f="$final" 'BEGIN { exit !(i > 0 && f < 0.4 * i) }'
check "demo showed progress" grep -q 'training' "$tmp/demo.err"
"$cli_bin" info --server "$addr" --json >"$tmp/info.json"
check "demo cleaned up its modules and contexts" \
  grep -q '"live_contexts":0,"module_list":\[\],"modules":0' "$tmp/info.json"

# info says what each module is, in the server's words (not "Linear" for every kind).
for kind in layernorm-mlp layernorm-linear linear; do
  "$load_bin" --server "$addr" --kind "$kind" --in 64 --out 32 --ffn 128 --rows 2 --count 1 \
    --warmup 0 --keep-module >/dev/null 2>&1
done
"$load_bin" --server "$addr" --kind linear --in 48 --out 16 --rows 3 --count 1 --warmup 0 \
  --recipe mxfp8 --keep-module >/dev/null 2>&1
"$cli_bin" info --server "$addr" >"$tmp/kinds.txt"
cat "$tmp/kinds.txt"
check "info: a LayerNormMLP" grep -q " LayerNormMLP 64 -> 128 -> 32, gelu, bias  v" "$tmp/kinds.txt"
check "info: a LayerNormLinear" grep -q " LayerNormLinear 64 -> 32, bias  v" "$tmp/kinds.txt"
check "info: a Linear" grep -q " Linear 64 -> 32, bias  v" "$tmp/kinds.txt"
# gradwire-load without --recipe: the server's --default-recipe (block).
check "info: each module's recipe" grep -q " Linear 64 -> 32, bias  v.* block scaling" "$tmp/kinds.txt"
check "info: an MXFP8 module" grep -q " Linear 48 -> 16, bias  v.* mxfp8 scaling" "$tmp/kinds.txt"
"$cli_bin" info --server "$addr" --json >"$tmp/kinds.json"
check "info --json: kind and description" \
  grep -q '"description":"LayerNormMLP 64 -> 128 -> 32, gelu, bias","in_features":64,"kind":"LAYERNORM_MLP"' \
  "$tmp/kinds.json"

check "info --json: the recipe" grep -q '"recipe":"mxfp8"' "$tmp/kinds.json"

# Health, as a container probe sees it: exit 0 only when SERVING.
check "health: SERVING, exit 0" bash -c "'$cli_bin' health --server '$addr' | grep -qx SERVING"
check "health of the gradwire service" \
  "$cli_bin" health --server "$addr" --service gradwire.v1.Gradwire
check "health of an unknown service: exit 1" bash -c "! '$cli_bin' health --server '$addr' --service nope 2>/dev/null"

# A second server on the same port is refused with a clear message.
port=${addr##*:}
set +e
"$server_bin" --listen "127.0.0.1:$port" >"$tmp/second.log" 2>&1
rc=$?
set -e
check "busy port: exit 1" [ "$rc" = 1 ]
check "busy port: says why" grep -q "cannot listen on 127.0.0.1:$port" "$tmp/second.log"

stop_server
check "SIGTERM: logged shutdown" grep -q "shutting down" "$tmp/server.log"
check "SIGTERM: stopped" grep -q "stopped:" "$tmp/server.log"

# JSON logs: every line one object, RPC lines with their request-scoped fields.
start_server --listen 127.0.0.1:0 --log-format json --log-level debug
"$cli_bin" demo --server "$addr" --steps 3 >/dev/null 2>&1
stop_server
check "json logs: every line is an object" \
  bash -c "! grep -qv '^{\"time\":\"[^\"]*\",\"level\":\"[a-z]*\",.*}\$' '$tmp/server.log'"
check "json logs: a Forward line with its module" \
  grep -q '"msg":"rpc","method":"Forward","code":"OK","duration_ms":[0-9.]*,"module":"[0-9a-f]\{32\}"' \
  "$tmp/server.log"

set +e
"$cli_bin" info --server "127.0.0.1:$port" --timeout 1 >"$tmp/unreach.txt" 2>&1
rc=$?
"$server_bin" --device bogus >"$tmp/bogus.txt" 2>&1
rc_bogus=$?
"$server_bin" --device cuda --listen 127.0.0.1:0 >"$tmp/cuda.txt" 2>&1
rc_cuda=$?
"$server_bin" --help >"$tmp/help.txt" 2>&1
rc_help=$?
set -e
check "unreachable server: exit 1" [ "$rc" = 1 ]
check "unreachable server: UNAVAILABLE" grep -q "UNAVAILABLE" "$tmp/unreach.txt"
check "health of a stopped server: exit 1" bash -c "! '$cli_bin' health --server '127.0.0.1:$port' --timeout 1 2>/dev/null"
check "bad --device refused" [ "$rc_bogus" != 0 ]
check "--device cuda without usable CUDA kernels: exit 2 with reason" \
  bash -c "[ $rc_cuda = 2 ] && grep -q -- '--device cuda' '$tmp/cuda.txt'"
check "--help exits 0" [ "$rc_help" = 0 ]
for flag in --listen --device --log-level --log-format --max-message-mib --shutdown-grace \
  --tls-cert --tls-key --tls-client-ca --insecure --metrics-listen --checkpoint-dir \
  --checkpoint-every --checkpoint-shared --checkpoint-check-every --checkpoint-handover-wait \
  --port-file --cpu-isa; do
  check "--help documents $flag" grep -q -- "$flag" "$tmp/help.txt"
done

# --port-file: the bound address for a supervisor, whatever the log level; removed at exit.
"$server_bin" --listen 127.0.0.1:0 --log-level warn --port-file "$tmp/port" >"$tmp/quiet.log" 2>&1 &
quiet_pid=$!
for _ in $(seq 1 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
check "--port-file: written at --log-level warn" grep -qE '^127\.0\.0\.1:[0-9]+$' "$tmp/port"
check "--port-file: the address serves" "$cli_bin" health --server "$(cat "$tmp/port")" --timeout 5
check "--log-level warn: no info lines" bash -c "! grep -q 'listening on' '$tmp/quiet.log'"
kill -TERM "$quiet_pid"
wait "$quiet_pid" || true
check "--port-file: removed at exit" [ ! -e "$tmp/port" ]
check "--port-file: an unwritable path is refused" \
  bash -c "! '$server_bin' --listen 127.0.0.1:0 --port-file /nonexistent-dir/port >/dev/null 2>&1"

# --cpu-isa: the FP8 GEMM's copy, named in the device description; a name that is no copy is
# refused. The baseline copy runs on every CPU.
"$server_bin" --listen 127.0.0.1:0 --cpu-isa baseline --port-file "$tmp/isa-port" \
  >"$tmp/isa.log" 2>&1 &
isa_pid=$!
for _ in $(seq 1 100); do [ -s "$tmp/isa-port" ] && break; sleep 0.1; done
check "--cpu-isa baseline: gradwire info names the copy" \
  bash -c "'$cli_bin' info --server \"\$(cat '$tmp/isa-port')\" | grep -q 'baseline micro-kernel'"
kill -TERM "$isa_pid"
wait "$isa_pid" || true
check "--cpu-isa: a name that is no copy is refused" \
  bash -c "! '$server_bin' --listen 127.0.0.1:0 --cpu-isa avx1024 >/dev/null 2>&1"

finish
