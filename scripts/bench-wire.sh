#!/usr/bin/env bash
# Wire benchmark: activation bytes/s through Forward (unary vs chunked, per wire dtype) next to
# raw loopback TCP, in one run. Prints the table and writes docs/perf/wire.json.
#   scripts/bench-wire.sh [wire_bench flags...]   e.g. --max-mib 64 --seconds 0.5
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/ccache.sh
source scripts/lib/ccache.sh
build_dir=${BUILD_DIR:-build}
cmake --build "$build_dir" -j "${JOBS:-2}" --target wire_bench
mkdir -p docs/perf
"$build_dir/tests/wire_bench" --json docs/perf/wire.json "$@"
