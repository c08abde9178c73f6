#!/usr/bin/env bash
# Configures and builds gradwire (server, CLI, tests) into build/ with Ninja, ccache, -j2.
#   scripts/build.sh [TARGET...]   only these targets (default: everything)
#   BUILD_DIR=... JOBS=... CMAKE_ARGS="..." to override.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/ccache.sh
source scripts/lib/ccache.sh
build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-2}
if [ ! -f "$build_dir/build.ninja" ]; then
  # shellcheck disable=SC2086
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${CMAKE_ARGS:-}
fi
start=$(date +%s)
if [ $# -gt 0 ]; then
  cmake --build "$build_dir" -j "$jobs" --target "$@"
else
  cmake --build "$build_dir" -j "$jobs"
fi
echo "build: done in $(( $(date +%s) - start )) s ($build_dir)"
