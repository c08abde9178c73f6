#!/usr/bin/env bash
# The metrics endpoint of a real gradwire-server (prometheus-cpp): bound to loopback by default;
# with --metrics-token-file it answers 401 without the bearer token or with a wrong one; the page
# a scrape gets after a few calls passes `promtool check metrics` (Prometheus's own linter) and
# carries every metric gradwire documents, with their labels.
#   usage: metrics_e2e.sh PATH/gradwire-server PATH/gradwire-load
set -euo pipefail
server_bin=$1
load_bin=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$root/scripts/lib/check.sh"
command -v promtool >/dev/null || { echo "metrics_e2e: promtool not found (scripts/install-deps.sh installs prometheus)"; exit 1; }

# GET http://ADDR/metrics with an optional Authorization header; prints the status code, writes
# the body to FILE and the headers to FILE.headers.
fetch() {  # fetch ADDR FILE [AUTHORIZATION]
  /usr/bin/python3 - "$@" <<'PY'
import sys, urllib.error, urllib.request
addr, out = sys.argv[1], sys.argv[2]
req = urllib.request.Request(f"http://{addr}/metrics")
if len(sys.argv) > 3:
    req.add_header("Authorization", sys.argv[3])
try:
    r = urllib.request.urlopen(req, timeout=5)
except urllib.error.HTTPError as e:
    r = e
open(out, "wb").write(r.read())
open(out + ".headers", "w").write("".join(f"{k}: {v}\n" for k, v in r.headers.items()))
print(r.status)
PY
}

# A bare port binds loopback only.
start_server --listen 127.0.0.1:0 --metrics-listen 0
check "a bare --metrics-listen port binds 127.0.0.1" grep -q 'metrics on http://127\.0\.0\.1:[0-9]*/metrics$' "$tmp/server.log"
stop_server

printf 'alice alice-token-0123456789abcdef\n' >"$tmp/tokens.txt"
echo alice-token-0123456789abcdef >"$tmp/alice.token"
echo scrape-token-0123456789abcdef >"$tmp/metrics.token"
start_server --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --metrics-token-file "$tmp/metrics.token" --tokens-file "$tmp/tokens.txt"
metrics=$(sed -n 's|.*metrics on http://\([^/]*\)/metrics.*|\1|p' "$tmp/server.log" | head -1)
check "the log says a token is required" grep -q 'metrics on http://.*/metrics (bearer token required)' "$tmp/server.log"
check "no token: 401" [ "$(fetch "$metrics" "$tmp/none")" = 401 ]
check "no token: WWW-Authenticate: Bearer" grep -qi '^WWW-Authenticate: Bearer' "$tmp/none.headers"
check "no token: nothing of the page" bash -c "! grep -q gradwire_ '$tmp/none'"
check "wrong token: 401" [ "$(fetch "$metrics" "$tmp/wrong" "Bearer scrape-token-0123456789abcdeX")" = 401 ]
check "basic auth instead of the bearer token: 401" \
  [ "$(fetch "$metrics" "$tmp/basic" "Basic $(printf 'x:scrape-token-0123456789abcdef' | base64)")" = 401 ]

# Calls to count: training steps as alice, one refused call without a token.
"$load_bin" --server "$addr" --token-file "$tmp/alice.token" --flow step --in 64 --out 32 \
  --rows 8 --warmup 0 --count 20 --recipe delayed --keep-module >"$tmp/load.out" 2>&1
"$load_bin" --server "$addr" --flow step --count 1 >/dev/null 2>&1 || true  # UNAUTHENTICATED
sleep 0.2  # a call is counted once gRPC is done with it, a moment after the client's answer
check "token: 200" [ "$(fetch "$metrics" "$tmp/page" "Bearer scrape-token-0123456789abcdef")" = 200 ]
check "token: the text format's content type" grep -qi '^Content-Type: text/plain; version=0.0.4' "$tmp/page.headers"
check "promtool check metrics passes" bash -c "promtool check metrics <'$tmp/page' >'$tmp/promtool.out' 2>&1 || { cat '$tmp/promtool.out'; exit 1; }"

# Every documented metric with its labels (README, deploy/README.md): the names dashboards and
# rules use.
present() { grep -qE "^$1" "$tmp/page" || { echo "missing: $1"; return 1; }; }
for m in \
  'gradwire_rpc_total\{code="OK",method="Forward"\} 20$' \
  'gradwire_rpc_total\{code="OK",method="Backward"\} 20$' \
  'gradwire_rpc_total\{code="UNAUTHENTICATED",method="[A-Za-z]+"\} 1$' \
  'gradwire_rpc_duration_seconds_bucket\{method="Forward",le="0.0005"\} ' \
  'gradwire_rpc_duration_seconds_bucket\{method="Forward",le="\+Inf"\} 20$' \
  'gradwire_rpc_duration_seconds_count\{method="Forward"\} 20$' \
  'gradwire_rpc_duration_seconds_sum\{method="Forward"\} ' \
  'gradwire_client_rpc_duration_seconds_count\{client="tenant alice",method="Backward"\} 20$' \
  'gradwire_queue_wait_seconds_count\{method="Forward"\} 20$' \
  'gradwire_queue_wait_seconds_bucket\{method="Forward",le="5e-05"\} ' \
  'gradwire_build_info\{device="cpu",version="[0-9.]+"\} 1$' \
  'gradwire_start_time_seconds [0-9.e+]+$' \
  'gradwire_modules 1$' 'gradwire_live_contexts 0$' 'gradwire_executor_queued_tasks 0$' \
  'gradwire_offloaded_contexts 0$' \
  'gradwire_context_bytes\{memory="device"\} 0$' 'gradwire_context_bytes\{memory="host"\} 0$' \
  'gradwire_context_budget_bytes\{memory="device"\} 4294967296$' \
  'gradwire_context_budget_bytes\{memory="host"\} 8589934592$' \
  'gradwire_context_bytes_peak\{memory="device"\} [1-9]' \
  'gradwire_pinned_weight_bytes 0$' 'gradwire_pinned_weight_bytes_peak [1-9]' \
  'gradwire_pinned_weight_versions 0$' \
  'gradwire_context_offloads_total 0$' 'gradwire_context_restores_total 0$' \
  'gradwire_context_evictions_total\{reason="ttl"\} 0$' \
  'gradwire_context_evictions_total\{reason="memory"\} 0$' \
  'gradwire_context_rejections_total 0$' 'gradwire_context_quota_rejections_total 0$' \
  'gradwire_context_share_rejections_total 0$' 'gradwire_modules_expired_total 0$' \
  'gradwire_workspace_builds_total 1$' 'gradwire_workspace_hits_total 19$' \
  'gradwire_gemm_flops_total [1-9]' 'gradwire_gemm_seconds_total [0-9]' \
  'gradwire_client_parameter_bytes\{client="tenant alice"\} [1-9]' \
  '# TYPE gradwire_client_context_bytes gauge' '# TYPE gradwire_client_stream_bytes gauge' \
  '# TYPE gradwire_client_queued_calls gauge' \
  'gradwire_module_weight_version\{module="[0-9a-f]{32}",name="[^"]*"\} 1$' \
  'gradwire_fp8_scale\{module="[0-9a-f]{32}",name="[^"]*",role="input"\} ' \
  'gradwire_fp8_amax\{module="[0-9a-f]{32}",name="[^"]*",role="input"\} '; do
  check "page has: $m" present "$m"
done
stop_server
finish metrics
