#!/usr/bin/env bash
# What the proxy costs: training steps through HAProxy (deploy/haproxy/haproxy.cfg, routing by
# gradwire-route) against the same steps sent to the server directly, side by side in one run on
# one server, so that only the proxy differs. For each case, gradwire-load runs the same flow
# against the proxy and against the server, taking turns in the order direct, proxy, proxy,
# direct; the table gives proxy / direct of the request rates and of the median latencies.
#   scripts/bench-proxy.sh [OUT.json] [SECONDS per case and path, 5]
# Needs build/server/gradwire-server and build/client/gradwire-load (scripts/build.sh
# gradwire-server gradwire-load) and haproxy (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
out_json=${1:-/tmp/bench-proxy.json}
secs=${2:-5}
command -v haproxy >/dev/null || { echo "bench-proxy: haproxy not found (scripts/install-deps.sh)"; exit 1; }
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$tmp"' EXIT
free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

build/server/gradwire-server --listen 127.0.0.1:0 --port-file "$tmp/port" --device cpu \
  --shared-memory off >"$tmp/server.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
direct=$(cat "$tmp/port")
proxy=127.0.0.1:$(free_port)
# One server behind the proxy: the other two lines point at ports nothing listens on, which the
# health checks take out of the ring at once.
GRADWIRE_SERVER_1=$direct GRADWIRE_SERVER_2=127.0.0.1:$(free_port) \
  GRADWIRE_SERVER_3=127.0.0.1:$(free_port) GRADWIRE_PROXY_LISTEN=$proxy \
  GRADWIRE_PROXY_ADMIN=127.0.0.1:$(free_port) \
  haproxy -f deploy/haproxy/haproxy.cfg -db >"$tmp/haproxy.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  build/client/gradwire health --server "$proxy" --timeout 2 >/dev/null 2>&1 && break
  sleep 0.1
done

# flow:in:out:rows:clients
cases=${BENCH_PROXY_CASES:-"step:1024:1024:16:1 step:1024:1024:256:1 step:1024:1024:16:8 stream:1024:1024:16:8"}
for c in $cases; do
  IFS=: read -r flow in outf rows clients <<< "$c"
  pass=0
  for path in direct proxy proxy direct; do
    pass=$((pass + 1))
    addr=$direct; [ "$path" = proxy ] && addr=$proxy
    build/client/gradwire-load --server "$addr" --flow "$flow" --in "$in" --out "$outf" \
      --rows "$rows" -c "$clients" --modules "$clients" --shared-memory off --warmup 1 \
      --duration "$secs" --json "$tmp/$path-$flow-$rows-$clients-$pass.json" >"$tmp/load.txt" 2>&1 ||
      { cat "$tmp/load.txt"; exit 1; }
  done
  echo "bench-proxy: $flow, $rows rows, $clients clients done" >&2
done
/usr/bin/python3 - "$tmp" "$out_json" "$cases" "$secs" <<'PY'
import glob, json, subprocess, sys
sys.path.insert(0, "scripts/lib")
from machine import commit as machine_commit, describe
tmp, out, cases = sys.argv[1], sys.argv[2], sys.argv[3].split()
def runs(pattern):
    return [x for path in glob.glob(pattern) for x in json.load(open(path))["runs"]
            if x["mode"] == "remote"]
def rate(rs):
    return sum(x["requests"] for x in rs) / sum(x["seconds"] for x in rs)
def p50(rs):
    return sorted(x["latency"]["p50_ms"] for x in rs)[len(rs) // 2]
def errors(rs):
    return sum(x["requests"] - x["ok"] for x in rs)
rows = []
print(f"{'case':<28} {'direct/s':>9} {'proxy/s':>9} {'rate ratio':>10} {'p50 direct':>11} "
      f"{'p50 proxy':>10} {'errors':>6}")
for c in cases:
    flow, inf, outf, n, clients = c.split(":")
    d = runs(f"{tmp}/direct-{flow}-{n}-{clients}-*.json")
    p = runs(f"{tmp}/proxy-{flow}-{n}-{clients}-*.json")
    row = {"flow": flow, "in": int(inf), "out": int(outf), "rows": int(n),
           "clients": int(clients), "direct_per_s": rate(d), "proxy_per_s": rate(p),
           "rate_ratio": rate(p) / rate(d), "p50_ms_direct": p50(d), "p50_ms_proxy": p50(p),
           "errors": errors(d) + errors(p)}
    rows.append(row)
    print(f"{flow + ' ' + inf + 'x' + outf + ' rows ' + n + ' c=' + clients:<28} "
          f"{row['direct_per_s']:>9.1f} {row['proxy_per_s']:>9.1f} {row['rate_ratio']:>10.3f} "
          f"{row['p50_ms_direct']:>11.2f} {row['p50_ms_proxy']:>10.2f} {row['errors']:>6}")
haproxy = subprocess.run(["haproxy", "-v"], capture_output=True, text=True).stdout.split("\n")[0]
commit = machine_commit()
json.dump({"benchmark": "bench-proxy", "machine": describe(), "commit": commit,
           "haproxy": haproxy, "seconds_per_run": float(sys.argv[4]),
           "order": "direct, proxy, proxy, direct", "cases": rows}, open(out, "w"), indent=2)
print("bench-proxy: wrote", out)
PY
