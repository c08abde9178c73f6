#!/usr/bin/env bash
# Command 2 of the README: install what is missing, build everything, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "${JOBS:-2}" --timeout 600
