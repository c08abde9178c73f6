#!/usr/bin/env bash
# Three gradwire-servers behind one address: Debian's HAProxy with deploy/haproxy/haproxy.cfg on
# loopback, routing each call by its gradwire-route header (docs/scaling-out.md). Every client
# routes every call about a module, so through the proxy:
#   - the CLI's demo and gradwire-load (step and Train-stream flows, --modules) run with no error,
#     and the load's modules spread over all three servers;
#   - training through the proxy gives the bits of the same training on one server directly;
#   - a call whose header names another module is refused, changing nothing;
#   - the servers share one checkpoint directory (--checkpoint-shared): a server killed under
#     load leaves the other servers' modules untouched (no error), and its modules serve again on
#     the others from their last checkpoint; brought back, it takes them back at their newest
#     versions and the servers that held them meanwhile let them go (tests/e2e/failover.py).
# A client that did not route a call would reach a random server, which two times in three does
# not hold the module: the runs here make hundreds of calls of every kind.
#   usage: proxy_e2e.sh PATH/gradwire-server PATH/gradwire PATH/gradwire-load
set -euo pipefail
server_bin=$1
cli_bin=$2
load_bin=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$root/scripts/lib/check.sh"
command -v haproxy >/dev/null || { echo "proxy_e2e: haproxy not found (scripts/install-deps.sh installs it)"; exit 1; }
python=/usr/bin/python3
export PYTHONPATH="$root/client/python${PYTHONPATH:+:$PYTHONPATH}"

# shellcheck source=SCRIPTDIR/../deploy/haproxy_lib.sh
server_flags=(--checkpoint-dir "$tmp/checkpoints" --checkpoint-shared --checkpoint-every 2)
source "$root/tests/deploy/haproxy_lib.sh"
start_cluster
servers="$(cat "$tmp/port1") $(cat "$tmp/port2") $(cat "$tmp/port3")"

check "HAProxy sees the three servers UP" wait_states "gradwire-1=UP gradwire-2=UP gradwire-3=UP"

check "gradwire demo through the proxy" \
  bash -c "'$cli_bin' demo --server '$proxy' >'$tmp/demo.log' 2>&1 || { tail -5 '$tmp/demo.log'; exit 1; }"

# gradwire-load over 30 modules (2^-17 that one server gets none), every call routed; the modules
# stay (--keep-module) so that where they went can be counted on each server directly.
for flow in step stream; do
  check "gradwire-load --flow $flow --modules 30 through the proxy: every call OK" \
    bash -c "'$load_bin' --server '$proxy' --flow $flow --modules 30 -c 30 --in 64 --out 32 \
      --rows 4 --warmup 0 --count 300 --keep-module --json '$tmp/load-$flow.json' \
      >'$tmp/load-$flow.out' 2>&1 || { tail -5 '$tmp/load-$flow.out'; exit 1; }
      '$python' - '$tmp/load-$flow.json' <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
remote = [x for x in r['runs'] if x['mode'] == 'remote'][0]
assert remote['codes'] == {'OK': 300}, remote['codes']
assert len(set(r['module_ids'])) == 30, r['module_ids']
PY"
done
check "the load's 60 modules are spread over all three servers" \
  "$python" - "$tmp/load-step.json" "$tmp/load-stream.json" $servers <<'PY'
import json, sys
import gradwire
ids = set()
for path in sys.argv[1:3]:
    ids |= set(json.load(open(path))["module_ids"])
counts = []
for server in sys.argv[3:]:
    with gradwire.Client(server) as c:
        counts.append(len(ids & {m.module_id for m in c.list_modules()}))
print("  modules per server:", counts)
assert sum(counts) == 60 and min(counts) > 0, counts
PY

# Training through the proxy against the same training on server 1 directly: the quickstart's
# model (remote LayerNormMLP and Linear, micro-batched on Train streams, AdamW on the client),
# its losses bit for bit.
check "training through the proxy gives the bits of training on one server" \
  "$python" - "$proxy" "$(cat "$tmp/port1")" "$root/client/python/examples" <<'PY'
import sys
sys.path.insert(0, sys.argv[3])
import gradwire
import quickstart
runs = []
for server in sys.argv[1:3]:
    with gradwire.Client(server) as c:
        runs.append(quickstart.run(c, steps=4, log=lambda s: None))
print("  losses through the proxy:", runs[0]["losses"])
assert runs[0]["losses"] == runs[1]["losses"], runs
assert runs[0]["restored_equal"] and runs[1]["restored_equal"]
PY

check "a call whose gradwire-route names another module is refused through the proxy" \
  "$python" - "$proxy" <<'PY'
import sys
import grpc
import gradwire
from gradwire.v1 import module_pb2, service_pb2
proxy = sys.argv[1]
with gradwire.Client(proxy) as c:
    spec = module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=16, out_features=8, seed=3)
    a = c.create_module(spec).module_id
    b = c.create_module(spec).module_id
    before, version = c.get_weights_versioned(a)
    stub = c._stub
    try:
        stub.ApplyGradients(service_pb2.ApplyGradientsRequest(module_id=a), timeout=10,
                            metadata=(("gradwire-route", b),))
        raise SystemExit("a misrouted call was served")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert a in e.details() and b in e.details() and "gradwire-route" in e.details(), e.details()
        print("  refused:", e.details()[:120], "...")
    after, version_after = c.get_weights_versioned(a)
    assert all(before[k].equal(after[k]) for k in before)
    assert version_after == version, (version, version_after)
PY

# A server killed under load, then brought back on its address.
victim_address=$(cat "$tmp/port2")
check "a killed server's modules serve again elsewhere from their checkpoints; the others see no error" \
  "$python" "$root/tests/e2e/failover.py" kill "$proxy" "$admin" "${server_pids[2]}" \
  "$tmp/failover.json" $servers
wait "${server_pids[2]}" 2>/dev/null || true
start_one 2 "$victim_address"
check "the killed server comes back UP" wait_states "gradwire-1=UP gradwire-2=UP gradwire-3=UP"
check "brought back, it takes its modules back at their newest versions; the others let them go" \
  "$python" "$root/tests/e2e/failover.py" return "$proxy" "$tmp/failover.json" $servers
finish proxy
