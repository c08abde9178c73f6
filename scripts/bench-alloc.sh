#!/usr/bin/env bash
# The allocator choice of docs/performance.md ("Memory that stays"), side by side in one run on one
# machine: alloc_bench (a large block malloc'ed, filled and freed, against one kept warm) and the
# wire benchmark's unary and zero-copy Forward paths at 16 and 64 MiB, under
#   glibc          the C library's defaults
#   glibc-retain   glibc as gradwire-server sets it at start (--heap-retain: no mmap per block)
#   jemalloc, tcmalloc, mimalloc   Debian's (libjemalloc2, libtcmalloc-minimal4, libmimalloc2.0),
#                  preloaded; one that is not installed is skipped and named
# then a table and docs/perf/allocators.json (or $1).
#   scripts/bench-alloc.sh [OUT.json] [wire seconds per point, default 0.3]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/ccache.sh
source scripts/lib/ccache.sh
out_json=${1:-docs/perf/allocators.json}
secs=${2:-0.3}
build_dir=${BUILD_DIR:-build}
cmake --build "$build_dir" -j "${JOBS:-2}" --target alloc_bench wire_bench
lib=/usr/lib/x86_64-linux-gnu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for name in glibc glibc-retain jemalloc tcmalloc mimalloc; do
  preload="" retain=false
  case $name in
    glibc-retain) retain=true ;;
    jemalloc) preload=$lib/libjemalloc.so.2 ;;
    tcmalloc) preload=$lib/libtcmalloc_minimal.so.4 ;;
    mimalloc) preload=$lib/libmimalloc.so.2 ;;
  esac
  if [ -n "$preload" ] && [ ! -e "$preload" ]; then
    echo "bench-alloc: $name skipped ($preload not installed)"
    continue
  fi
  tune=()
  # alloc_bench has no mallopt call of its own: the same policy through glibc's tunables.
  $retain && tune=(GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647)
  env ${preload:+LD_PRELOAD=$preload} "${tune[@]}" "$build_dir/tests/alloc_bench" 20 \
    > "$tmp/alloc-$name.jsonl"
  env ${preload:+LD_PRELOAD=$preload} "$build_dir/tests/wire_bench" --heap-retain "$retain" \
    --min-kib 16384 --max-mib 64 --dtypes f32 --paths unary zero-copy --seconds "$secs" \
    --json "$tmp/wire-$name.json" > "$tmp/wire-$name.txt" 2>&1
  echo "bench-alloc: $name done"
done
python3 - "$tmp" "$out_json" <<'PY'
import glob, json, os, sys
sys.path.insert(0, "scripts/lib")
from machine import describe
tmp, out = sys.argv[1], sys.argv[2]
runs = []
for path in sorted(glob.glob(f"{tmp}/alloc-*.jsonl")):
    name = os.path.basename(path)[len("alloc-"):-len(".jsonl")]
    alloc = [json.loads(line) for line in open(path)]
    wire = json.load(open(f"{tmp}/wire-{name}.json"))["rows"]
    runs.append({"allocator": name, "alloc_bench": alloc,
                 "wire": [r for r in wire if r["path"] in ("unary", "zero-copy", "tcp")]})
order = ["glibc", "glibc-retain", "jemalloc", "tcmalloc", "mimalloc"]
runs.sort(key=lambda r: order.index(r["allocator"]))
print(f"\n{'allocator':<14} | fresh ms 16/64/256 MiB | warm ms 64 MiB | wire GiB/s unary 16/64, zero-copy 16/64 | vs TCP (best)")
for r in runs:
    a = {x["mib"]: x for x in r["alloc_bench"]}
    w = {(x["path"], x["bytes"] >> 20): x for x in r["wire"]}
    tcp = max(x["gib_per_s"] for x in r["wire"] if x["path"] == "tcp")
    best = max(x["wire_gib_per_s"] for x in r["wire"] if x["path"] != "tcp")
    print(f"{r['allocator']:<14} | {a[16]['fresh_ms']:6.1f} {a[64]['fresh_ms']:6.1f} {a[256]['fresh_ms']:7.1f} |"
          f" {a[64]['warm_ms']:6.1f} | {w[('unary', 16)]['wire_gib_per_s']:5.2f} {w[('unary', 64)]['wire_gib_per_s']:5.2f}"
          f" {w[('zero-copy', 16)]['wire_gib_per_s']:5.2f} {w[('zero-copy', 64)]['wire_gib_per_s']:5.2f} | {best / tcp:5.2f}")
json.dump({"benchmark": "allocators", "command": "scripts/bench-alloc.sh",
           "machine": describe(allocator="per run (see runs)"), "runs": runs},
          open(out, "w"), indent=2)
print(f"bench-alloc: wrote {out}")
PY
