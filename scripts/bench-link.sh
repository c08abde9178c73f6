#!/usr/bin/env bash
# The step across a network link: gradwire-server (--device cpu) and a torch.distributed.rpc peer
# in a network namespace of their own, joined to this one by a veth pair whose two ends are each
# shaped by tc tbf (so both directions run at the link rate), the clients here. For each link
# rate, each case (Linear 1024->1024 and LayerNormMLP 1024/4096 at 16, 256 and 4096 rows) and
# each gradwire wire form: training steps/s of gradwire-load (C++) and of the Python client,
# against torch.distributed.rpc + dist_autograd over TensorPipe's TCP transport (uv, basic
# channel: no shared memory) sending the full output gradient. Bytes per step are counted on
# the veth (both directions); the link floor is those bytes at the link rate. Prints a table and
# writes docs/perf/link.json (or --json) with the machine and the link.
#   scripts/bench-link.sh [--json OUT] [--seconds S per case, tool and form, default 3]
#                         [--rates "10 1" (Gbit/s)] [--forms "f32 fp8"] [--cases "kind:in:out:ffn:rows ..."]
#   scripts/bench-link.sh --check [--server-bin PATH] [--load-bin PATH]
# --check is the short variant of the README test command: the namespace and the shaped link
# come up, each wire form crosses it with the bits it gives over loopback, and the clients fall
# back from shared memory to the wire. No timing. Without root or iproute2 (or where namespaces
# cannot be made) it says why and exits 77 (ctest: skipped).
# Only loopback and the addresses made here (10.200.X.1/30 here, 10.200.X.2/30 in the namespace,
# X picked free) are used.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# The gradwire wire forms, each a value of gradwire-load --wire-dtype and of the Python
# Client(wire_dtype=...): a new form joins the benchmark and the check as one more word here (or
# in --forms; bf16 is optional). "exact" (the clients' default, docs/wire.md) must change no
# result, so it is also checked against f32's bits (EQUALS_F32 in tests/bench/link_check.py).
default_forms="exact f32 fp8"
mode=bench
out_json=docs/perf/link.json
secs=3
rates="10 1"
forms=$default_forms
cases="linear:1024:1024:0:16 linear:1024:1024:0:256 linear:1024:1024:0:4096"
cases+=" mlp:1024:1024:4096:16 mlp:1024:1024:4096:256 mlp:1024:1024:4096:4096"
server_bin=build/server/gradwire-server
load_bin=build/client/gradwire-load
while [ $# -gt 0 ]; do
  case $1 in
    --check) mode=check ;;
    --json) out_json=$2; shift ;;
    --seconds) secs=$2; shift ;;
    --rates) rates=$2; shift ;;
    --forms) forms=$2; shift ;;
    --cases) cases=$2; shift ;;
    --server-bin) server_bin=$2; shift ;;
    --load-bin) load_bin=$2; shift ;;
    -h|--help) sed -n "2,19p" "$0"; exit 0 ;;
    *) echo "bench-link: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done
py=/usr/bin/python3
export PYTHONPATH=$root/client/python
# gRPC and the torch rendezvous would honour a proxy from the environment: nothing but the link.
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY grpc_proxy all_proxy ALL_PROXY

# shellcheck source=scripts/lib/check.sh
source scripts/lib/check.sh  # $tmp, check, finish, and the trap that runs cleanup_more

ns=""
pids=()
cleanup_more() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  if [ -n "$ns" ]; then
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true  # takes the veth pair with it
  fi
}

cannot() {  # cannot REASON: skip (--check) or fail (the benchmark)
  if [ "$mode" = check ]; then
    echo "bench-link --check: SKIPPED: $1"
    exit 77
  fi
  echo "bench-link: $1" >&2
  exit 1
}
[ "$(id -u)" = 0 ] || cannot "needs root to make a network namespace (this is uid $(id -u))"
command -v ip >/dev/null || cannot "needs iproute2's ip"
command -v tc >/dev/null || cannot "needs iproute2's tc (tbf) to shape the link"
[ -x "$server_bin" ] || cannot "no $server_bin (scripts/build.sh gradwire-server gradwire-load)"
[ -x "$load_bin" ] || cannot "no $load_bin (scripts/build.sh gradwire-server gradwire-load)"

# The namespace and the link. A free X: none of 10.200.X.0/24 on this host, and the namespace
# name gwlink-X (which `ip netns add` makes atomically) not taken by another run.
x=""
start_x=$(( $$ % 200 + 20 ))
for i in $(seq 0 49); do
  cand=$(( (start_x + i) % 230 + 20 ))
  if ip -4 -o addr show | grep -q " 10\.200\.$cand\."; then continue; fi
  if ip netns add "gwlink-$cand" 2>"$tmp/netns.err"; then x=$cand; ns=gwlink-$cand; break; fi
  grep -q "File exists" "$tmp/netns.err" || cannot "ip netns add failed: $(cat "$tmp/netns.err")"
done
[ -n "$x" ] || cannot "no free gwlink-X namespace name among 50"
host_dev=gwl${x}h
ns_dev=gwl${x}n
host_ip=10.200.$x.1
ns_ip=10.200.$x.2
nsx() { ip netns exec "$ns" "$@"; }  # (background jobs call ip directly: $! is then theirs)
ip link add "$host_dev" type veth peer name "$ns_dev" netns "$ns" ||
  cannot "cannot make a veth pair"
ip addr add "$host_ip/30" dev "$host_dev"
ip link set "$host_dev" up
ip -n "$ns" addr add "$ns_ip/30" dev "$ns_dev"
ip -n "$ns" link set "$ns_dev" up
ip -n "$ns" link set lo up
echo "bench-link: namespace $ns, $host_dev $host_ip <-> $ns_dev $ns_ip"

# tbf on the egress of each end: host -> namespace on $host_dev, namespace -> host on $ns_dev.
# Bucket: 1 ms at the rate, at least 128 KiB (above one 64 KiB GSO packet); queue: 20 ms more.
burst_of() { local b=$(( $1 * 1000000000 / 8 / 1000 )); [ $b -lt 131072 ] && b=131072; echo $b; }
limit_of() { echo $(( $(burst_of "$1") + $1 * 1000000000 / 8 / 50 )); }
shape() {  # shape GBIT
  local b l
  b=$(burst_of "$1"); l=$(limit_of "$1")
  tc qdisc replace dev "$host_dev" root tbf rate "${1}gbit" burst "$b" limit "$l"
  tc -n "$ns" qdisc replace dev "$ns_dev" root tbf rate "${1}gbit" burst "$b" limit "$l"
}
link_bytes() {  # bytes sent + received by the host end so far
  echo $(( $(cat "/sys/class/net/$host_dev/statistics/tx_bytes") +
           $(cat "/sys/class/net/$host_dev/statistics/rx_bytes") ))
}

server_port=50051
metrics_port=9464
start_ns_server() {  # gradwire-server in the namespace: on its veth address and its loopback
  # 0.0.0.0 inside the namespace is its loopback and its end of the veth, nothing else: a
  # network of this script only, hence --insecure (no TLS, no tokens).
  # The log is emptied before the launch, so a restart never reads the last server's lines.
  : >"$tmp/server.log"
  # shellcheck disable=SC2086
  ip netns exec "$ns" "$server_bin" --listen "0.0.0.0:$server_port" --insecure --device cpu \
    --metrics-listen "127.0.0.1:$metrics_port" ${BENCH_SERVER_FLAGS:-} >>"$tmp/server.log" 2>&1 &
  server_ns_pid=$!
  pids+=("$server_ns_pid")
  for _ in $(seq 300); do
    grep -q "listening on" "$tmp/server.log" && return 0
    kill -0 "$server_ns_pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "bench-link: the server did not start:"; cat "$tmp/server.log"; exit 1
}
stop_ns_server() {
  kill -TERM "$server_ns_pid" 2>/dev/null || true
  wait "$server_ns_pid" 2>/dev/null || true
}
scrape() {  # the server's Prometheus page, read inside the namespace
  nsx curl -sf "http://127.0.0.1:$metrics_port/metrics"
}
shm_calls() {  # CreateSharedMemory calls the server answered with CODE ($1)
  scrape | awk -v c="$1" '/^gradwire_rpc_total\{/ && /method="CreateSharedMemory"/ &&
    index($0, "code=\"" c "\"") { n += $NF } END { print n + 0 }'
}

if [ "$mode" = check ]; then
  shape 1
  check "tbf shapes both ends at 1 Gbit/s" bash -c \
    "tc qdisc show dev $host_dev | grep -q 'tbf.*rate 1Gbit' &&
     tc -n $ns qdisc show dev $ns_dev | grep -q 'tbf.*rate 1Gbit'"
  start_ns_server
  addr=$ns_ip:$server_port
  before=$(link_bytes)
  for form in $forms; do
    "$load_bin" --server "$addr" --kind linear --in 1024 --out 1024 --rows 64 --flow step \
      --count 3 --warmup 0 --wire-dtype "$form" --json "$tmp/load-$form.json" \
      >"$tmp/load-$form.txt" 2>&1 || cat "$tmp/load-$form.txt"
    check "gradwire-load, $form wire: 3 steps across the link, on the wire (no shared memory)" \
      "$py" -c "import json; r = json.load(open('$tmp/load-$form.json'))
run = r['runs'][0]
assert run['mode'] == 'remote' and run['ok'] == 3 and r['wire_dtype'] == '$form', run"
  done
  moved=$(( $(link_bytes) - before ))
  check "the steps crossed the veth ($moved bytes counted)" [ "$moved" -gt $(( 3 * 64 * 1024 * 4 )) ]
  csv_forms=$(echo "$forms" | tr ' ' ,)
  nsx "$py" tests/bench/link_check.py reference --server "127.0.0.1:$server_port" --dir "$tmp" \
    --forms "$csv_forms" >"$tmp/ref.txt" 2>&1 || { cat "$tmp/ref.txt"; exit 1; }
  cat "$tmp/ref.txt"
  if "$py" tests/bench/link_check.py compare --server "$addr" --dir "$tmp" --forms "$csv_forms" \
       >"$tmp/cmp.txt" 2>&1; then cmp_rc=0; else cmp_rc=$?; fi
  cat "$tmp/cmp.txt"
  check "Python client: every form across the link = loopback, bit for bit" [ "$cmp_rc" = 0 ]
  refused=$(shm_calls FAILED_PRECONDITION)
  granted=$(shm_calls OK)
  check "the server refused shared memory to the link's clients ($refused refused, $granted granted)" \
    bash -c "[ $refused -ge 1 ] && [ $granted = 0 ]"
  stop_ns_server
  finish link
  exit
fi

# --- the benchmark --------------------------------------------------------------------------
mkdir -p "$(dirname "$out_json")"
cut -d' ' -f1-3 /proc/loadavg >"$tmp/load-before.txt"  # a busy machine shows here
: >"$tmp/load.tsv"
tcp_rate() {  # plain TCP, host -> namespace: what the shaped link delivers (Gbit/s)
  local mib=$1
  ip netns exec "$ns" "$py" -c "
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('$ns_ip', 5201)); s.listen(1); c, _ = s.accept()
while c.recv(1 << 20): pass
c.sendall(b'k'); c.close()" &
  local sink=$!
  pids+=("$sink")
  sleep 1
  "$py" -c "
import socket, time
c = socket.create_connection(('$ns_ip', 5201)); buf = bytes(1 << 20)
t = time.perf_counter()
for _ in range($mib): c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1)
print(f'{$mib * 8 * 1048576 / (time.perf_counter() - t) / 1e9:.3f}')"
  wait "$sink" 2>/dev/null || true
}
json_get() { "$py" -c "import json,sys; r=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }

for rate in $rates; do
  shape "$rate"
  tcp=$(tcp_rate $(( rate * 64 )))
  echo "$rate $tcp" >>"$tmp/tcp.txt"
  echo "bench-link: link at $rate Gbit/s (tbf); plain TCP host -> namespace: $tcp Gbit/s"
  start_ns_server
  addr=$ns_ip:$server_port
  for c in $cases; do
    IFS=: read -r kind in outf ffn rows <<<"$c"
    module=(--kind linear); [ "$kind" = mlp ] && module=(--kind layernorm-mlp --ffn "$ffn")
    for form in $forms; do
      # shellcheck disable=SC2206  # BENCH_LOAD_FLAGS: words
      common=(--server "$addr" --rows "$rows" --flow step --warmup 0 --wire-dtype "$form"
              --timeout 600 ${BENCH_LOAD_FLAGS:-})
      # 1: make the module (kept) and warm it; 2: one step on it; 3: N steps on it. The bytes of
      # a step: (bytes of 3 - bytes of 2) / (N - 1), so the calls around the steps cancel out.
      "$load_bin" "${common[@]}" "${module[@]}" --in "$in" --out "$outf" --count 1 \
        --keep-module --json "$tmp/l1.json" >"$tmp/l.txt" 2>&1 || { cat "$tmp/l.txt"; exit 1; }
      id=$(json_get "$tmp/l1.json" "r['module_id']")
      b0=$(link_bytes)
      "$load_bin" "${common[@]}" --module "$id" --count 1 --json "$tmp/l2.json" >"$tmp/l.txt" 2>&1 ||
        { cat "$tmp/l.txt"; exit 1; }
      b1=$(link_bytes)
      n=$(json_get "$tmp/l2.json" "max(2, min(2000, int($secs * r['runs'][0]['requests_per_s']) + 1))")
      "$load_bin" "${common[@]}" --module "$id" --count "$n" --json "$tmp/l3.json" >"$tmp/l.txt" 2>&1 ||
        { cat "$tmp/l.txt"; exit 1; }
      b2=$(link_bytes)
      sps=$(json_get "$tmp/l3.json" "r['runs'][0]['requests_per_s']")
      path=$(json_get "$tmp/l3.json" "r['runs'][0]['mode']")
      bps=$(( (b2 - b1 - (b1 - b0)) / (n - 1) ))
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$rate" "$kind" "$in" "$outf" "$ffn" \
        "$rows" "$form" "$sps" "$bps" "$n" "$path" >>"$tmp/load.tsv"
      echo "bench-link: $rate Gbit/s, gradwire-load $kind x$rows, $form wire: $sps steps/s, $bps B/step"
    done
  done
  for form in $forms; do
    "$py" tests/bench/python_step.py --server "$addr" --cases "$(echo "$cases" | tr ' ' ,)" \
      --duration "$secs" --min-steps 2 --warmup 1 --wire-dtype "$form" --link-dev "$host_dev" --insecure \
      --json "$tmp/python-$rate-$form.json" | sed "s/^/bench-link: $rate Gbit\/s, $form wire: /"
  done
  echo "$rate $(shm_calls OK) $(shm_calls FAILED_PRECONDITION)" >>"$tmp/shm.txt"
  stop_ns_server
  ip netns exec "$ns" "$py" tests/bench/torch_link.py --role server --addr "$ns_ip" --ifname "$ns_dev" \
    >"$tmp/torch-server.log" 2>&1 &
  torch_pid=$!
  pids+=("$torch_pid")
  "$py" tests/bench/torch_link.py --role client --addr "$ns_ip" --ifname "$host_dev" \
    --link-dev "$host_dev" --cases "$(echo "$cases" | tr ' ' ,)" --duration "$secs" \
    --min-steps 2 --warmup 1 --json "$tmp/torch-$rate.json" | sed "s/^/bench-link: $rate Gbit\/s, /" ||
    { cat "$tmp/torch-server.log"; exit 1; }
  wait "$torch_pid"
done

backend=$(grep -o "on cpu: .*" "$tmp/server.log" | head -1 | cut -c9-)
cut -d' ' -f1-3 /proc/loadavg >"$tmp/load-after.txt"
"$py" - "$tmp" "$out_json" "$rates" "$forms" "$cases" "$backend" "$secs" \
  "$host_dev" "$ns_dev" "$host_ip" "$ns_ip" \
  "$(for r in $rates; do echo "$r:$(burst_of "$r"):$(limit_of "$r")"; done)" <<'PY'
import json, sys
sys.path.insert(0, "scripts/lib")
from machine import describe
(tmp, out, rates, forms, cases, backend, secs, host_dev, ns_dev, host_ip, ns_ip,
 buckets) = sys.argv[1:]
buckets = [b.split(":") for b in buckets.split()]
rates, forms, cases = rates.split(), forms.split(), cases.split()
tcp = dict(l.split() for l in open(f"{tmp}/tcp.txt"))
shm = {l.split()[0]: l.split()[1:] for l in open(f"{tmp}/shm.txt")}
load = {}
for line in open(f"{tmp}/load.tsv"):
    rate, kind, d_in, d_out, ffn, rows, form, sps, bps, n, path = line.rstrip("\n").split("\t")
    load[(rate, kind, rows, form)] = {"steps_per_s": float(sps), "bytes_per_step": int(bps),
                                      "steps": int(n), "path": "gRPC" if path == "remote" else path}
rows_out = []
mib = 1 << 20
hdr = (f"{'link':>5} {'case':<24} {'client':<16} {'steps/s':>8} {'MiB/step':>9} "
       f"{'floor ms':>9} {'floor/s':>8} {'vs rpc':>7}")
print(hdr)
print("-" * len(hdr))
for rate in rates:
    bits = float(rate) * 1e9
    pyr = {f: {(c["kind"], str(c["rows"])): c for c in json.load(open(f"{tmp}/python-{rate}-{f}.json"))["cases"]}
           for f in forms}
    tr = {(c["kind"], str(c["rows"])): c for c in json.load(open(f"{tmp}/torch-{rate}.json"))["cases"]}
    for c in cases:
        kind, d_in, d_out, ffn, r = c.split(":")
        t = tr[(kind, r)]
        entries = [("torch.rpc (uv)", "-", t["rpc_steps_per_s"], t["link_bytes_per_step"], "TCP")]
        for f in forms:
            l = load[(rate, kind, r, f)]
            entries.append((f"gradwire-load", f, l["steps_per_s"], l["bytes_per_step"], l["path"]))
        for f in forms:
            p = pyr[f][(kind, r)]
            entries.append((f"python", f, p["python_steps_per_s"], p["link_bytes_per_step"], p["path"]))
        name = f"{kind} {d_in}->{d_out}" + (f"/{ffn}" if kind == "mlp" else "") + f" x{r}"
        row = {"link_gbit_s": float(rate), "kind": kind, "in": int(d_in), "out": int(d_out),
               "ffn": int(ffn), "rows": int(r), "clients": []}
        rpc_sps = t["rpc_steps_per_s"]
        for client, form, sps, bps, path in entries:
            floor_s = bps * 8 / bits
            e = {"client": client, "wire": form, "steps_per_s": sps, "bytes_per_step": bps,
                 "link_floor_ms": floor_s * 1e3, "link_floor_steps_per_s": 1 / floor_s,
                 "vs_torch_rpc": sps / rpc_sps, "path": path}
            row["clients"].append(e)
            label = client if form == "-" else f"{client} {form}"
            print(f"{rate:>5} {name:<24} {label:<16} {sps:8.2f} {bps / mib:9.3f} "
                  f"{floor_s * 1e3:9.2f} {1 / floor_s:8.1f} {sps / rpc_sps:7.2f}")
        rows_out.append(row)
    print("-" * len(hdr))
print(f"MiB/step: both directions, on the veth. floor: those bytes at the link rate (ms; the "
      f"steps/s it allows). vs rpc: steps/s / torch.rpc's. Plain TCP, Gbit/s: {tcp}")
paths = {e["path"] for r in rows_out for e in r["clients"] if e["client"] != "torch.rpc (uv)"}
json.dump({
    "machine": describe(allocator="glibc; gradwire-server and gradwire-load retain large blocks "
                                  "(--heap-retain), PyTorch runs with the defaults", server=backend),
    "command": "scripts/bench-link.sh",
    "seconds_per_case": float(secs),
    "load_average_1_5_15_min": {"start": [float(v) for v in open(f"{tmp}/load-before.txt").read().split()],
                                "end": [float(v) for v in open(f"{tmp}/load-after.txt").read().split()]},
    "unit": "training steps per second (forward + backward), one client, closed loop",
    "link": {
        "kind": "veth pair between this network namespace (clients) and one made for the "
                "servers; tc tbf on the egress of each end, so each direction runs at the rate",
        "host_end": f"{host_dev} {host_ip}/30", "namespace_end": f"{ns_dev} {ns_ip}/30",
        "mtu": int(open(f"/sys/class/net/{host_dev}/mtu").read()),
        "tbf": {r: {"burst_bytes": int(b), "limit_bytes": int(l)} for r, b, l in buckets},
        "rates_gbit_s": [float(r) for r in rates],
        "plain_tcp_gbit_s": {r: float(v) for r, v in tcp.items()},
        "bytes_per_step": "both directions, counted on the host end of the veth "
                          "(/sys/class/net/DEV/statistics tx_bytes + rx_bytes): payload and "
                          "headers as the veth sees them (GSO packets, one set of headers each)",
        "link_floor": "bytes per step x 8 / rate: a step's four transfers run one after another",
    },
    "gradwire": {"forms": forms, "paths": sorted(paths),
                 "server_create_shared_memory": {r: {"OK": int(v[0]), "FAILED_PRECONDITION": int(v[1])}
                                                 for r, v in shm.items()},
                 "bytes_from": "gradwire-load: (bytes of N steps - bytes of 1 step) / (N - 1), "
                               "runs on a kept module; python: the measured steps"},
    "torch_rpc": {"backend": "TensorPipe", "transports": ["uv"], "channels": ["basic"],
                  "step": "rpc_sync forward, dist_autograd.backward of (y * g).sum(): full dY"},
    "cases": rows_out}, open(out, "w"), indent=2)
print(f"bench-link: wrote {out}; gradwire paths: {', '.join(sorted(paths))}; server's "
      f"CreateSharedMemory per link (OK, refused): {shm}")
PY
