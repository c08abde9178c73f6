#!/usr/bin/env bash
# A real Prometheus (Debian's, 2.42) scrapes a gradwire-server through its bearer-token-protected
# metrics endpoint, every second, while gradwire-load trains against it for about 20 s (tenant
# alice) and another tenant keeps making a mistake (NOT_FOUND; tenant bob, over raw gRPC). Prometheus evaluates
# deploy/observability/gradwire-rules.yaml as it goes. Then every panel query of the Grafana
# dashboard and every recording rule is evaluated through Prometheus's HTTP API at an instant
# inside the load, and checked for series with sane values (check_prometheus.py).
#   usage: prometheus_e2e.sh PATH/gradwire-server PATH/gradwire-load
set -euo pipefail
server_bin=$1
load_bin=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$root/scripts/lib/check.sh"
for tool in prometheus /usr/bin/python3; do
  command -v "$tool" >/dev/null || { echo "prometheus_e2e: $tool not found (scripts/install-deps.sh installs it)"; exit 1; }
done
seconds=${GRADWIRE_PROMETHEUS_E2E_SECONDS:-20}
prom_pid="" errors_pid=""
cleanup_more() {
  for pid in $errors_pid $prom_pid; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}

printf 'alice alice-token-0123456789abcdef\nbob bob-token-0123456789abcdef\n' >"$tmp/tokens.txt"
echo alice-token-0123456789abcdef >"$tmp/alice.token"
echo bob-token-0123456789abcdef >"$tmp/bob.token"
echo scrape-token-0123456789abcdef >"$tmp/metrics.token"
start_server --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --metrics-token-file "$tmp/metrics.token" --tokens-file "$tmp/tokens.txt" \
  --context-memory 64MiB --host-offload-memory 64MiB
metrics=$(sed -n 's|.*metrics on http://\([^/]*\)/metrics.*|\1|p' "$tmp/server.log" | head -1)
[ -n "$metrics" ] || { echo "no metrics address:"; cat "$tmp/server.log"; exit 1; }

# A free port for Prometheus's web API (bound and released; Prometheus takes it a moment later).
prom_port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$tmp/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - $root/deploy/observability/gradwire-rules.yaml
scrape_configs:
  - job_name: gradwire
    authorization:
      type: Bearer
      credentials_file: $tmp/metrics.token
    static_configs:
      - targets: ["$metrics"]
YAML
prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" --log.level=warn >"$tmp/prometheus.log" 2>&1 &
prom_pid=$!
api="http://127.0.0.1:$prom_port"
# Ready, and the first scrape of the server done.
up=0
for _ in $(seq 1 100); do
  if /usr/bin/python3 - "$api" <<'PY' 2>/dev/null; then up=1; break; fi
import json, sys, urllib.request
targets = json.load(urllib.request.urlopen(sys.argv[1] + "/api/v1/targets", timeout=1))
assert any(t["health"] == "up" for t in targets["data"]["activeTargets"])
PY
  kill -0 "$prom_pid" 2>/dev/null || break
  sleep 0.1
done
check "prometheus started and scrapes the server" [ "$up" = 1 ]
[ "$up" = 1 ] || { cat "$tmp/prometheus.log"; finish prometheus; }

# Tenant bob deletes a module that does not exist (NOT_FOUND), every 0.2 s, while the load runs.
/usr/bin/python3 - "$addr" "$root/client/python" <<'PY' >"$tmp/errors.log" 2>&1 &
import sys, time
sys.path.insert(0, sys.argv[2])
import grpc
from gradwire.v1 import service_pb2, service_pb2_grpc
stub = service_pb2_grpc.GradwireStub(grpc.insecure_channel(sys.argv[1]))
auth = (("authorization", "Bearer bob-token-0123456789abcdef"),)
while True:
    try:
        stub.DeleteModule(service_pb2.DeleteModuleRequest(module_id="0" * 31 + "1"), metadata=auth)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
    time.sleep(0.2)
PY
errors_pid=$!
start=$(date +%s.%N)
"$load_bin" --server "$addr" --token-file "$tmp/alice.token" --flow step --concurrency 2 \
  --in 256 --out 256 --rows 32 --warmup 0 --duration "$seconds" --json "$tmp/load.json" \
  >"$tmp/load.out" 2>"$tmp/load.err" || { cat "$tmp/load.out" "$tmp/load.err"; exit 1; }
kill "$errors_pid" 2>/dev/null || true
errors_pid=""
check "gradwire-load ran without errors" /usr/bin/python3 -c "
import json, sys
r = json.load(open('$tmp/load.json'))['runs'][0]
sys.exit(0 if r['ok'] == r['requests'] > 0 else 1)"
# The instant the queries are evaluated at: 3 s before the load ended, so every rate window ends
# inside the load and the load's module (its parameters) was still there. Rule evaluations for
# that instant are done a second later; wait for them.
at=$(/usr/bin/python3 -c "print($start + $seconds - 3)")
sleep 1
check "dashboard panels and recording rules evaluate to sane series" \
  /usr/bin/python3 "$root/tests/observability/check_prometheus.py" --url "$api" --time "$at" \
  --dashboard "$root/deploy/observability/gradwire-dashboard.json" \
  --rules "$root/deploy/observability/gradwire-rules.yaml" \
  --client "tenant alice" --error-code NOT_FOUND
stop_server
finish prometheus
