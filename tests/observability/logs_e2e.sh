#!/usr/bin/env bash
# Requests you can follow, on the real binaries: the gradwire CLI sends a W3C traceparent and logs
# it (--verbose); the server, with --log-format json, writes one JSON object a line, and the lines
# about a call carry its trace-id as request_id (and its parent id), as does the error the client
# gets. A call without a traceparent gets a request id made by the server; a malformed one is
# replaced.
#   usage: logs_e2e.sh PATH/gradwire-server PATH/gradwire
set -euo pipefail
server_bin=$1
cli_bin=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$root/scripts/lib/check.sh"

start_server --listen 127.0.0.1:0 --log-format json --log-level debug
# A CLI call, logged with its traceparent.
"$cli_bin" info --server "$addr" --verbose >"$tmp/info.out" 2>"$tmp/info.err"
# Raw gRPC calls that fail (NOT_FOUND): with a client's traceparent, without one, and with a
# malformed one.
traced=4bf92f3577b34da6a3ce929d0e0e4736
/usr/bin/python3 - "$addr" "$root/client/python" "$traced" >"$tmp/raw.out" 2>&1 <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
import grpc
from gradwire.v1 import service_pb2, service_pb2_grpc
stub = service_pb2_grpc.GradwireStub(grpc.insecure_channel(sys.argv[1]))
for metadata in ((("traceparent", f"00-{sys.argv[3]}-00f067aa0ba902b7-01"),), (),
                 (("traceparent", "00-not-a-trace-context-01"),)):
    try:
        stub.DeleteModule(service_pb2.DeleteModuleRequest(module_id="f" * 32), metadata=metadata)
    except grpc.RpcError as e:
        print(e.code().name, e.details())
PY
sleep 0.3  # the last call's line is written once gRPC is done with it
stop_server

ok_id=$(sed -n 's/.* GetServerInfo to .*traceparent=00-\([0-9a-f]\{32\}\)-[0-9a-f]\{16\}-01.*/\1/p' "$tmp/info.err" | head -1)
check "the CLI logs its call's traceparent with --verbose (on stderr)" [ -n "$ok_id" ]
check "the CLI's stdout stays clean" bash -c "! grep -q traceparent '$tmp/info.out'"
check "a failed call's error ends with its traceparent's trace-id" \
  grep -q "^NOT_FOUND .*\[request $traced\]$" "$tmp/raw.out"
check "every line of the server's log is one JSON object" /usr/bin/python3 - "$tmp/server.log" <<'PY'
import json, sys
for n, line in enumerate(open(sys.argv[1]), 1):
    obj = json.loads(line)
    assert isinstance(obj, dict) and {"time", "level"} <= obj.keys(), (n, line)
    assert obj["time"].endswith("Z"), (n, line)
PY
rpc_line() {  # rpc_line ID PARENT METHOD CODE: the call's RPC line has these fields
  /usr/bin/python3 - "$tmp/server.log" "$@" <<'PY'
import json, sys
log, rid, parent, method, code = sys.argv[1:]
lines = [json.loads(l) for l in open(log)]
rpc = [l for l in lines if l.get("msg") == "rpc" and l.get("request_id") == rid]
assert len(rpc) == 1 and rpc[0]["method"] == method and rpc[0]["code"] == code, rpc
assert rpc[0]["parent_id"] == parent or (parent == "any" and len(rpc[0]["parent_id"]) == 16), rpc
PY
}
check "the server's RPC line carries the CLI's trace-id" rpc_line "$ok_id" any GetServerInfo OK
check "the server's RPC line carries the client's trace-id and parent id (failed call)" \
  rpc_line "$traced" 00f067aa0ba902b7 DeleteModule NOT_FOUND
check "calls without a valid traceparent get a request id made by the server" /usr/bin/python3 - "$tmp/raw.out" "$tmp/server.log" <<'PY'
import json, re, sys
ids = re.findall(r"\[request ([0-9a-f]{32})\]", open(sys.argv[1]).read())[1:]
assert len(ids) == 2 and ids[0] != ids[1], ids
lines = [json.loads(l) for l in open(sys.argv[2])]
for rid in ids:
    rpc = [l for l in lines if l.get("msg") == "rpc" and l.get("request_id") == rid]
    assert len(rpc) == 1 and rpc[0]["method"] == "DeleteModule" and rpc[0]["parent_id"] == "", rpc
PY
finish logs
