#!/usr/bin/env bash
# The compile step of the image builds (the Dockerfile's builder stages run it in /src): configures
# a Release build without the tests, adding the CMake arguments given, builds gradwire-server,
# gradwire and gradwire-load, and installs them to /out; --strip strips the installed binaries.
#   usage: scripts/container-build.sh [--strip] [CMAKE-ARGS...]
set -euo pipefail
strip=0
if [ "${1:-}" = --strip ]; then
  strip=1
  shift
fi
cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADWIRE_BUILD_TESTS=OFF "$@"
cmake --build /build -j"$(nproc)" --target gradwire-server gradwire gradwire-load
install -D -m 0755 /build/server/gradwire-server /out/gradwire-server
install -D -m 0755 /build/client/gradwire /out/gradwire
install -D -m 0755 /build/client/gradwire-load /out/gradwire-load
if [ "$strip" = 1 ]; then strip /out/gradwire-server /out/gradwire /out/gradwire-load; fi
