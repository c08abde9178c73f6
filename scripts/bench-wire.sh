#!/usr/bin/env bash
# Wire benchmark: activation bytes/s through Forward (unary vs chunked, per wire dtype) next to
# raw loopback TCP, in one run. Prints the table and writes docs/perf/wire.json (or $WIRE_JSON),
# with the machine it ran on.
#   scripts/bench-wire.sh [wire_bench flags...]   e.g. --max-mib 64 --seconds 0.5
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/ccache.sh
source scripts/lib/ccache.sh
build_dir=${BUILD_DIR:-build}
cmake --build "$build_dir" -j "${JOBS:-2}" --target wire_bench
mkdir -p docs/perf
out_json=${WIRE_JSON:-docs/perf/wire.json}
"$build_dir/tests/wire_bench" --json "$out_json" "$@"
# The machine it ran on, in the same JSON (a figure holds only where it was measured).
python3 - "$out_json" "$*" <<'PY'
import json, sys
sys.path.insert(0, "scripts/lib")
from machine import describe
path, args = sys.argv[1], sys.argv[2]
data = json.load(open(path))
retain = "--heap-retain false" not in args and "--heap-retain=false" not in args
data["machine"] = describe(allocator="glibc, large blocks retained (--heap-retain)" if retain
                           else "glibc defaults")
data["command"] = "scripts/bench-wire.sh " + args
json.dump(data, open(path, "w"), indent=2)
PY
