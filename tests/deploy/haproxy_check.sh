#!/usr/bin/env bash
# Checks the HAProxy configurations of deploy/ (deploy/haproxy/haproxy.cfg for compose and local
# runs, deploy/k8s/overlays/haproxy/haproxy.cfg for Kubernetes):
#   - `haproxy -c` accepts each, with the environment it expects (and, for Kubernetes, throwaway
#     TLS files where the Secret would be), without warnings;
#   - both send the same health check, and its bytes are the HTTP/2 request they describe:
#     grpc.health.v1.Health/Check for gradwire.v1.Gradwire, passing on SERVING only.
# Given the binaries, it also runs the compose configuration in front of two real servers on
# loopback: the checks mark them UP, calls pass through, a stopped server goes DOWN while the
# other keeps answering, and with none left the proxy answers UNAVAILABLE.
#   usage: haproxy_check.sh [PATH/gradwire-server PATH/gradwire]
set -euo pipefail
server_bin=${1:-}
cli_bin=${2:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$root/scripts/lib/check.sh"
need() { command -v "$1" >/dev/null || { echo "haproxy_check: $1 not found (scripts/install-deps.sh installs it)"; exit 1; }; }
need haproxy
need openssl
python=/usr/bin/python3
echo "haproxy_check: $(haproxy -v | head -1)"

compose_cfg="$root/deploy/haproxy/haproxy.cfg"
k8s_cfg="$root/deploy/k8s/overlays/haproxy/haproxy.cfg"

# haproxy -c, failing on warnings as well as errors (its output is kept in $tmp/NAME.out).
config_ok() {  # config_ok NAME FILE
  if haproxy -c -f "$2" >"$tmp/$1.out" 2>&1 && ! grep -q -e WARNING -e ALERT "$tmp/$1.out"; then
    return 0
  fi
  cat "$tmp/$1.out"
  return 1
}

# The compose file with loopback servers (as on a host) and with its defaults (compose's service
# names, which do not resolve here: HAProxy then starts them without an address, by design).
check "deploy/haproxy/haproxy.cfg: valid with loopback servers" \
  env GRADWIRE_SERVER_1=127.0.0.1:50061 GRADWIRE_SERVER_2=127.0.0.1:50062 \
  GRADWIRE_SERVER_3=127.0.0.1:50063 GRADWIRE_PROXY_LISTEN=127.0.0.1:50051 \
  GRADWIRE_PROXY_ADMIN=127.0.0.1:8404 bash -c "$(declare -f config_ok); tmp='$tmp'; config_ok compose '$compose_cfg'"
check "deploy/haproxy/haproxy.cfg: valid with its defaults (compose's service names)" \
  haproxy -c -q -f "$compose_cfg"

# The Kubernetes file reads the Secret's files under /etc/gradwire/tls: point it at throwaway ones.
mkdir -p "$tmp/tls"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=gradwire \
  -addext subjectAltName=DNS:gradwire -keyout "$tmp/tls/tls.crt.key" -out "$tmp/tls/tls.crt" 2>/dev/null
cp "$tmp/tls/tls.crt" "$tmp/tls/ca.crt"
sed "s#/etc/gradwire/tls/#$tmp/tls/#g" "$k8s_cfg" >"$tmp/k8s.cfg"
check "deploy/k8s/overlays/haproxy/haproxy.cfg: valid (POD_NAMESPACE set, throwaway TLS files)" \
  env POD_NAMESPACE=gradwire bash -c "$(declare -f config_ok); tmp='$tmp'; config_ok k8s '$tmp/k8s.cfg'"

health_lines() { grep -E '^ +tcp-check (send-binary|expect) ' "$1" | sed 's/^ *//'; }
check "both send the same health check" \
  diff <(health_lines "$compose_cfg") <(health_lines "$k8s_cfg")
check "the health check is grpc.health.v1.Health/Check for gradwire.v1.Gradwire, SERVING only" \
  "$python" - "$compose_cfg" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
sent = bytes.fromhex("".join(re.findall(r"^ +tcp-check send-binary ([0-9a-f]+)$", text, re.M)))
expect = bytes.fromhex(re.search(r"^ +tcp-check expect binary ([0-9a-f]+)$", text, re.M).group(1))
preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
assert sent.startswith(preface)
frames, p = [], sent[len(preface):]
while p:
    n = int.from_bytes(p[:3], "big")
    frames.append((p[3], p[4], int.from_bytes(p[5:9], "big"), p[9:9 + n]))
    p = p[9 + n:]
assert [(t, f, s) for t, f, s, _ in frames] == [(4, 0, 0), (1, 4, 1), (0, 1, 1)], frames
assert frames[0][3] == b""  # SETTINGS, empty; HEADERS with END_HEADERS; DATA with END_STREAM
# HPACK: indexed fields and literals without indexing (no Huffman coding), RFC 7541 static table.
static = {1: ":authority", 2: ":method", 3: ":method", 4: ":path", 6: ":scheme", 31: "content-type"}
values = {2: "GET", 3: "POST", 6: "http"}
headers, b = {}, frames[1][3]
def integer(b, i, bits):
    v = b[i] & ((1 << bits) - 1); i += 1
    if v == (1 << bits) - 1:
        shift = 0
        while True:
            v += (b[i] & 0x7f) << shift; shift += 7; i += 1
            if not b[i - 1] & 0x80:
                return v, i
    return v, i
def string(b, i):
    assert not b[i] & 0x80, "Huffman-coded string"
    n, i = integer(b, i, 7)
    return b[i:i + n].decode(), i + n
i = 0
while i < len(b):
    if b[i] & 0x80:
        idx, i = integer(b, i, 7); headers[static[idx]] = values[idx]
    else:
        assert b[i] & 0xf0 == 0, "only literals without indexing"
        idx, i = integer(b, i, 4)
        name, i = (static[idx], i) if idx else string(b, i)
        headers[name], i = string(b, i)
assert headers == {":method": "POST", ":scheme": "http", ":path": "/grpc.health.v1.Health/Check",
                   ":authority": "gradwire", "content-type": "application/grpc",
                   "te": "trailers"}, headers
# One uncompressed gRPC message: HealthCheckRequest{service (field 1) = "gradwire.v1.Gradwire"}.
data = frames[2][3]
assert data[0] == 0 and int.from_bytes(data[1:5], "big") == len(data) - 5
service = b"gradwire.v1.Gradwire"
assert data[5:] == b"\x0a" + bytes([len(service)]) + service, data
# The expected bytes: the end of a DATA frame header on stream 1 and the message
# HealthCheckResponse{status (field 1) = SERVING (1)}.
assert expect == (1).to_bytes(4, "big") + b"\x00" + (2).to_bytes(4, "big") + b"\x08\x01", expect.hex()
print("  health check: HEADERS %s, DATA %s" % (headers, data.hex()))
PY

if [ -z "$server_bin" ]; then
  echo "skip the live check: no gradwire-server and gradwire given"
  finish haproxy
  exit
fi

# Live: two servers on loopback, HAProxy with the compose configuration in front of them. The
# third server line points at a port nothing listens on: it must show DOWN from the start.
# shellcheck source=SCRIPTDIR/haproxy_lib.sh
source "$root/tests/deploy/haproxy_lib.sh"
start_one 1
start_one 2
proxy=127.0.0.1:$(free_port)
admin=127.0.0.1:$(free_port)
GRADWIRE_SERVER_1=$(cat "$tmp/port1") GRADWIRE_SERVER_2=$(cat "$tmp/port2") \
  GRADWIRE_SERVER_3=127.0.0.1:$(free_port) GRADWIRE_PROXY_LISTEN=$proxy GRADWIRE_PROXY_ADMIN=$admin \
  haproxy -f "$compose_cfg" -db >"$tmp/haproxy.log" 2>&1 &
pids+=($!)

check "the health checks mark the two servers UP and the missing one DOWN" \
  wait_states "gradwire-1=UP gradwire-2=UP gradwire-3=DOWN"
check "/healthz answers 200" \
  "$python" -c "import urllib.request; assert urllib.request.urlopen('http://$admin/healthz', timeout=3).status == 200"
check "gradwire health through the proxy: SERVING" \
  bash -c "'$cli_bin' health --server '$proxy' --timeout 5 >/dev/null"
check "gradwire info through the proxy" \
  bash -c "'$cli_bin' info --server '$proxy' --timeout 5 | grep -q '^version'"

# Calls with a route key: each key reaches one server, the same one on every call; the log line
# of each call names its server and key.
route_calls() {  # route_calls OUT: 40 keys, 3 calls each; OUT gets "key server" lines
  "$python" - "$proxy" "$tmp/haproxy.log" "$1" <<'PY'
import re, sys, time, grpc
proxy, log, out = sys.argv[1:4]
start = sum(1 for _ in open(log))
check = grpc.insecure_channel(proxy).unary_unary("/grpc.health.v1.Health/Check")
for i in range(40):
    for _ in range(3):
        assert check(b"", timeout=5, metadata=(("gradwire-route", "module-%d" % i),)) == b"\x08\x01"
time.sleep(0.3)
where = {}
for line in list(open(log))[start:]:
    m = re.search(r"gradwire/(gradwire-\d) .*\{(module-\d+)\}", line)
    if m:
        where.setdefault(m.group(2), set()).add(m.group(1))
assert len(where) == 40 and all(len(s) == 1 for s in where.values()), where
with open(out, "w") as f:
    for key, servers in sorted(where.items()):
        f.write("%s %s\n" % (key, servers.pop()))
PY
}
check "gradwire-route: every call of a key on one server, keys on both servers" \
  bash -c "$(declare -f route_calls); python='$python' proxy='$proxy' tmp='$tmp'; route_calls '$tmp/routes1' && [ \$(cut -d' ' -f2 '$tmp/routes1' | sort -u | wc -l) = 2 ]"

kill -TERM "${server_pids[2]}"
check "a stopped server goes DOWN" wait_states "gradwire-1=UP gradwire-2=DOWN gradwire-3=DOWN"
check "gradwire-route: only the stopped server's keys move" \
  bash -c "$(declare -f route_calls); python='$python' proxy='$proxy' tmp='$tmp'; route_calls '$tmp/routes2' &&
    join '$tmp/routes1' '$tmp/routes2' | awk '\$2 != \$3 && \$2 != \"gradwire-2\" {bad = 1} END {exit bad}'"
check "gradwire health through the proxy with one server left: SERVING" \
  bash -c "'$cli_bin' health --server '$proxy' --timeout 5 >/dev/null"

kill -TERM "${server_pids[1]}"
check "with no server up the proxy answers UNAVAILABLE, naming why" \
  bash -c "for _ in \$(seq 1 75); do
      out=\$('$cli_bin' health --server '$proxy' --timeout 5 2>&1) && exit 1
      case \$out in *'UNAVAILABLE'*'no gradwire server available'*) exit 0 ;; esac
      sleep 0.2
    done; echo \"  \$out\"; exit 1"
finish haproxy
