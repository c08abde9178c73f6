#!/usr/bin/env bash
# Command 2 of the README: install what is missing, build everything, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
# A build folder that scripts/demo.sh configured before the test tools were installed has the
# Python tests off: configuring again (seconds, nothing rebuilt) lets it see what is here now.
if [ -f "${BUILD_DIR:-build}/build.ninja" ]; then
  cmake -S . -B "${BUILD_DIR:-build}" >/dev/null
fi
./scripts/build.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "${JOBS:-2}" --timeout 600
