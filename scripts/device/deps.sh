#!/usr/bin/env bash
# Here (a Debian 12 machine with apt, repo root): pack the C++ libraries the GPU machine lacks
# (gRPC/protobuf C++, spdlog, GoogleTest, ...) as Debian packages into .device-deps/, an ignored
# folder the device tool carries. scripts/device/env.sh unpacks them there. Run it right before
# each device call: it also records the commit the tree is at (.device-deps/commit).
#   scripts/device/deps.sh            everything gpu-check.sh and stage2.sh need
#   scripts/device/deps.sh --gtest    GoogleTest only (stage 1)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .device-deps
pkgs=(libgtest-dev libgmock-dev googletest)
if [ "${1:-}" != "--gtest" ]; then
  pkgs+=(
    libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29 protobuf-compiler-grpc
    libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc32 protobuf-compiler
    libabsl-dev libabsl20220623 libre2-dev libre2-9 libc-ares-dev libc-ares2
    libssl-dev libssl3 zlib1g-dev libbrotli-dev libbrotli1
    libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
    libcli11-dev nlohmann-json3-dev libcpp-httplib-dev libcpp-httplib0.11
    # prometheus-cpp's CMake config finds civetweb, ZLIB and CURL (pull and push); the server
    # links only its core.
    prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0
    libprometheus-cpp-push1.0 civetweb libcivetweb-dev libcivetweb1 libcurl4-openssl-dev libcurl4
  )
fi
cd .device-deps
[ -n "$(find /var/lib/apt/lists -name '*Packages*' -print -quit 2>/dev/null)" ] || apt-get update -qq
for p in "${pkgs[@]}"; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p" >/dev/null 2>&1 \
    || echo "device deps: could not download $p (skipped)" >&2
done
# The commit this tree is at, for the GPU machine's report: the device copy's .git can be older.
git rev-parse HEAD > commit
git status --porcelain | wc -l > tree_changes
# Each tracked file's hash: gpu-check.sh counts there the files that differ from what this run
# saw (an edit or a commit after it), and says the recorded commit is stale if any do.
(cd .. && git ls-files -z | xargs -0 sha1sum 2>/dev/null) > manifest || true
du -sh . | sed 's/^/device deps: /'
echo "device deps: recorded commit $(cut -c1-12 commit), $(cat tree_changes) uncommitted changes"
if [ "$(cat tree_changes)" != 0 ]; then
  echo "device deps: WARNING: commit first, so that the report's commit names what ran" >&2
fi
