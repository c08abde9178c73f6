#!/usr/bin/env bash
# Soak: starts gradwire-server (from build/) and runs gradwire-soak against it.
#   scripts/soak.sh [seconds, default 60] [gradwire-soak flags...]
# e.g. scripts/soak.sh 600 --clients 8 for the 10-minute run. SOAK_SERVER_FLAGS adds server flags
# (e.g. a context memory budget); BUILD_DIR=... picks the build. Builds the two binaries first
# unless SOAK_SKIP_BUILD is set.
# Fails when gradwire-soak fails (see tests/soak/soak.cc) or the server dies.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/ccache.sh
source scripts/lib/ccache.sh
seconds=${1:-60}
shift || true
build_dir=${BUILD_DIR:-build}
if [ -z "${SOAK_SKIP_BUILD:-}" ]; then
  [ -f "$build_dir/build.ninja" ] || ./scripts/build.sh
  cmake --build "$build_dir" -j "${JOBS:-2}" --target gradwire-server gradwire-soak
fi
# shellcheck source=SCRIPTDIR/lib/check.sh
source ./scripts/lib/check.sh
# shellcheck disable=SC2086
"$build_dir/server/gradwire-server" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  ${SOAK_SERVER_FLAGS:-} >"$tmp/server.log" 2>&1 &
server_pid=$!
addr="" metrics=""
for _ in $(seq 1 200); do
  addr=$(sed -n 's/.*listening on \([^" ]*\).*/\1/p' "$tmp/server.log" | head -1)
  metrics=$(sed -n 's|.*metrics on http://\([^/]*\)/metrics.*|\1|p' "$tmp/server.log" | head -1)
  [ -n "$addr" ] && [ -n "$metrics" ] && break
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$addr" ]; then
  echo "soak: server did not start:" >&2
  cat "$tmp/server.log" >&2
  exit 1
fi
echo "soak: server pid $server_pid on $addr, metrics on ${metrics:-none}, ${seconds} s"
rc=0
"$build_dir/tests/soak/gradwire-soak" --server "$addr" --server-pid "$server_pid" \
  --metrics "$metrics" --seconds "$seconds" "$@" || rc=$?
if ! kill -0 "$server_pid" 2>/dev/null; then
  echo "soak: FAIL the server died; its log:" >&2
  tail -50 "$tmp/server.log" >&2
  exit 1
fi
if grep -qE "\] \[(error|critical)\]" "$tmp/server.log"; then
  echo "soak: FAIL the server logged errors:" >&2
  grep -E "\] \[(error|critical)\]" "$tmp/server.log" | head -20 >&2
  rc=1
fi
exit "$rc"
