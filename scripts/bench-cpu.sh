#!/usr/bin/env bash
# The CPU step benchmark of docs/performance.md, in one run on one machine: for Linear 1024->1024
# at 16, 256 and 4096 rows and LayerNormMLP 1024/4096 at 256 rows, training steps/s of
#   gradwire remote (C++ load tool), gradwire in-process (the same ModuleHost, no gRPC),
#   gradwire remote from the Python client, local fp32 PyTorch, torch.distributed.rpc +
#   dist_autograd (tests/bench/torch_peer.py),
# then a table and docs/perf/cpu-step.json (or $1). Both PyTorch sides use OpenBLAS
# (libopenblas0-pthread, installed by scripts/install-deps.sh); gradwire's CPU backend its FP8 GEMM
# (the default; BENCH_SERVER_FLAGS="--cpu-gemm blas" puts the server on the same OpenBLAS).
#   scripts/bench-cpu.sh [OUT.json] [SECONDS per case and mode, default 5]
set -euo pipefail
cd "$(dirname "$0")/.."
out_json=${1:-docs/perf/cpu-step.json}
secs=${2:-5}
tmp=$(mktemp -d)
trap 'kill $server_pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
# BENCH_SERVER_FLAGS go to the server, BENCH_LOAD_FLAGS to gradwire-load (its in-process
# baseline), e.g. "--cpu-gemm-threads blas" to both for the other GEMM threading.
# shellcheck disable=SC2086
build/server/gradwire-server --listen 127.0.0.1:0 --device cpu ${BENCH_SERVER_FLAGS:-} \
  > "$tmp/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do grep -q "listening on" "$tmp/server.log" && break; sleep 0.1; done
addr=$(grep -o "listening on [0-9.:]*" "$tmp/server.log" | awk '{print $3}')
echo "bench-cpu: server at $addr"
cases="linear:1024:1024:0:16 linear:1024:1024:0:256 linear:1024:1024:0:4096 mlp:1024:1024:4096:256"
for c in $cases; do
  IFS=: read -r kind in outf ffn rows <<< "$c"
  module=(--kind linear); [ "$kind" = mlp ] && module=(--kind layernorm-mlp --ffn "$ffn")
  build/client/gradwire-load --server "$addr" "${module[@]}" --in "$in" --out "$outf" \
    --rows "$rows" --flow step --warmup 1 --duration "$secs" --baselines \
    --rounds 2 ${BENCH_LOAD_FLAGS:-} --json "$tmp/load-$kind-$rows.json" > "$tmp/load-$kind-$rows.txt" 2>&1 \
    || { cat "$tmp/load-$kind-$rows.txt"; exit 1; }
  echo "bench-cpu: gradwire-load $kind rows $rows done"
done
PYTHONPATH=client/python /usr/bin/python3 tests/bench/python_step.py \
  --server "$addr" --cases "$(echo $cases | tr ' ' ,)" --duration "$secs" --json "$tmp/python.json"
backend=$(grep -o "on cpu: .*" "$tmp/server.log" | head -1 | cut -c9-)
kill $server_pid; wait $server_pid 2>/dev/null || true
/usr/bin/python3 tests/bench/torch_peer.py --cases "$(echo $cases | tr ' ' ,)" \
  --duration "$secs" --threads "$(nproc)" --json "$tmp/torch.json"
/usr/bin/python3 - "$tmp" "$out_json" "$cases" "$backend" <<'PY'
import json, os, sys
sys.path.insert(0, "scripts/lib")
from machine import describe
tmp, out, cases, backend = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]
py = {(c["kind"], c["rows"]): c for c in json.load(open(f"{tmp}/python.json"))["cases"]}
th = json.load(open(f"{tmp}/torch.json"))
tt = {(c["kind"], c["rows"]): c for c in th["cases"]}
rows = []
print(f"{'case':<28} {'remote':>8} {'in-proc':>8} {'python':>8} {'torch':>8} {'torch.rpc':>9} |"
      f" {'remote/rpc':>10} {'in-proc/torch (time)':>20}")
for c in cases:
    kind, d_in, d_out, ffn, r = c.split(":")
    load = json.load(open(f"{tmp}/load-{kind}-{r}.json"))
    # "remote-shm": the load tool passed the tensors through shared memory by itself (its
    # default on this host once a worker's tensors reach 64 KiB).
    modes = {x["mode"] for x in load["runs"]}
    remote = "remote-shm" if "remote-shm" in modes else "remote"
    rate = {m: sum(x["requests"] for x in load["runs"] if x["mode"] == src) /
               sum(x["seconds"] for x in load["runs"] if x["mode"] == src)
            for m, src in (("remote", remote), ("in-process", "in-process"))}
    p, t = py[(kind, int(r))], tt[(kind, int(r))]
    row = {"kind": kind, "in": int(d_in), "out": int(d_out), "ffn": int(ffn), "rows": int(r),
           "gradwire_remote_steps_per_s": rate["remote"],
           "gradwire_remote_path": "shared memory" if remote == "remote-shm" else "gRPC",
           "gradwire_python_path": p.get("path", "gRPC"),
           "gradwire_inprocess_steps_per_s": rate["in-process"],
           "gradwire_python_steps_per_s": p["python_steps_per_s"],
           "torch_local_steps_per_s": t["local_steps_per_s"],
           "torch_rpc_steps_per_s": t["rpc_steps_per_s"]}
    row["remote_vs_torch_rpc"] = row["gradwire_remote_steps_per_s"] / row["torch_rpc_steps_per_s"]
    row["python_vs_torch_rpc"] = row["gradwire_python_steps_per_s"] / row["torch_rpc_steps_per_s"]
    row["inprocess_time_vs_torch_local"] = (row["torch_local_steps_per_s"] /
                                            row["gradwire_inprocess_steps_per_s"])
    rows.append(row)
    name = f"{kind} {d_in}->{d_out}" + (f"/{ffn}" if kind == "mlp" else "") + f" x{r}"
    print(f"{name:<28} {rate['remote']:8.2f} {rate['in-process']:8.2f} "
          f"{p['python_steps_per_s']:8.2f} {t['local_steps_per_s']:8.2f} "
          f"{t['rpc_steps_per_s']:9.2f} | {row['remote_vs_torch_rpc']:10.2f} "
          f"{row['inprocess_time_vs_torch_local']:20.2f}")
json.dump({"machine": describe(allocator="glibc; gradwire-server and gradwire-load retain large "
                                         "blocks (--heap-retain), PyTorch runs with the defaults",
                               server=backend),
           "command": "scripts/bench-cpu.sh", "unit": "training steps per second (forward + backward)",
           "server_flags": os.environ.get("BENCH_SERVER_FLAGS", ""),
           "load_flags": os.environ.get("BENCH_LOAD_FLAGS", ""),
           # The recipe of modules created without one (gradwire-load and the Python client
           # leave it to the server), as the server's log says.
           "server_default_recipe": next(
               (line.split(" get ")[1].split()[0] for line in open(f"{tmp}/server.log")
                if "modules created without a recipe get" in line), "unknown"),
           "torch": th["torch"], "blas": "OpenBLAS (libopenblas0-pthread) for PyTorch; gradwire: the server's --cpu-gemm "
                   "(the FP8 GEMM unless BENCH_SERVER_FLAGS says blas)",
           "cases": rows}, open(out, "w"), indent=2)
print(f"bench-cpu: wrote {out}")
PY
