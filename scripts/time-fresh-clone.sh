#!/usr/bin/env bash
# The README's two commands timed as a newcomer meets them: a fresh clone of HEAD in a bare
# debian:bookworm-slim container (no packages, no ccache cache), with the host's CUDA toolkit
# mounted where the machine has one, then scripts/demo.sh and scripts/test.sh one after the other.
# Prints each command's seconds, the build's and the tests' share, and the slowest compilations,
# and writes them with the machine to OUT.json (default docs/perf/fresh-clone.json). Takes 20 to
# 30 minutes on 2 cores; run it on an idle machine.
#   scripts/time-fresh-clone.sh [OUT.json]
# Needs podman (or docker) and a local debian:bookworm-slim image.
set -euo pipefail
cd "$(dirname "$0")/.."
out_json=${1:-docs/perf/fresh-clone.json}
engine=$(command -v podman || command -v docker || true)
[ -n "$engine" ] || { echo "time-fresh-clone: neither podman nor docker found" >&2; exit 1; }
work=$(mktemp -d /tmp/gradwire-fresh.XXXX)
trap 'rm -rf "$work"' EXIT
git clone -q . "$work/src"
mkdir -p "$work/out"
cat >"$work/out/run.sh" <<'EOF'
#!/bin/bash
set -u
cd /src
if [ -d /usr/local/cuda/lib ]; then echo /usr/local/cuda/lib > /etc/ld.so.conf.d/cuda.conf; ldconfig; fi
t0=$(date +%s)
./scripts/demo.sh >/out/demo.log 2>&1; echo "demo_rc $?" >>/out/times
t1=$(date +%s)
cp build/.ninja_log /out/ninja_demo
./scripts/test.sh >/out/test.log 2>&1; echo "test_rc $?" >>/out/times
t2=$(date +%s)
cp build/.ninja_log /out/ninja_test
echo "demo_s $((t1 - t0))" >>/out/times
echo "test_s $((t2 - t1))" >>/out/times
EOF
cuda=()
if [ -d /usr/local/cuda ]; then
  real=$(readlink -f /usr/local/cuda)
  cuda=(-v "$real:/usr/local/cuda:ro" -e CUDA_HOME=/usr/local/cuda
        -e LIBRARY_PATH=/usr/local/cuda/lib64/stubs
        -e PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
fi
echo "time-fresh-clone: $(git rev-parse --short HEAD) in debian:bookworm-slim (${cuda:+CUDA mounted})"
"$engine" run --rm --network=host --privileged "${cuda[@]}" -v "$work/src:/src" \
  -v "$work/out:/out" debian:bookworm-slim bash /out/run.sh
python3 - "$work/out" "$out_json" <<'EOF'
import json, os, platform, subprocess, sys
out, path = sys.argv[1], sys.argv[2]
times = dict(l.split() for l in open(os.path.join(out, "times")))
def steps(name):
    rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(out, name)) if not l.startswith("#")]
    rows = [(int(r[1]) - int(r[0])) / 1000 for r in rows], [r[3] for r in rows], rows
    wall = max(int(r[1]) for r in rows[2]) / 1000 if rows[2] else 0
    slow = sorted(zip(rows[0], rows[1]), reverse=True)[:5]
    return {"steps": len(rows[2]), "build_s": wall, "slowest": [[n, s] for s, n in slow]}
lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
model = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), "")
flags = next((l.split(":", 1)[1].split() for l in lscpu.splitlines() if l.startswith("Flags")), [])
result = {
    "benchmark": "fresh clone, README commands", "what": "scripts/demo.sh then scripts/test.sh in a bare debian:bookworm-slim container, no ccache cache",
    "demo_s": int(times["demo_s"]), "demo_rc": int(times["demo_rc"]),
    "test_s": int(times["test_s"]), "test_rc": int(times["test_rc"]),
    "demo_build": steps("ninja_demo"), "test_build": steps("ninja_test"),
    "machine": {"cpu": model, "cores": os.cpu_count(), "isa": [f for f in flags if f.startswith(("avx", "fma"))],
                "kernel": platform.release(), "load_average_after": os.getloadavg()},
}
with open(path, "w") as f:
    json.dump(result, f, indent=1)
print(f"demo.sh {result['demo_s']} s (rc {result['demo_rc']}), test.sh {result['test_s']} s (rc {result['test_rc']})")
for key in ("demo_build", "test_build"):
    b = result[key]
    print(f"{key}: {b['steps']} steps, {b['build_s']:.0f} s; slowest: " + ", ".join(f"{n} {s:.0f} s" for n, s in b["slowest"][:3]))
print(f"wrote {path}")
EOF
