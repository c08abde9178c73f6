#!/usr/bin/env bash
# Command 1 of the README: install what is missing, build, start gradwire-server on loopback,
# run the CLI demo against it (a two-layer model trained remotely in FP8), stop the server.
#   extra arguments go to `gradwire demo` (e.g. --steps 500 --json)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh build  # the build's packages only: the demo runs no test tools
# Only what the demo runs: the server and the CLI (the tests build with scripts/test.sh).
./scripts/build.sh gradwire-server gradwire
build_dir=${BUILD_DIR:-build}
log=$(mktemp)
"$build_dir/server/gradwire-server" --listen 127.0.0.1:0 >"$log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 100); do
  grep -q 'listening on' "$log" && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
addr=$(sed -n 's/.*listening on //p' "$log" | head -1)
if [ -z "$addr" ]; then
  echo "demo: gradwire-server did not start:" >&2
  cat "$log" >&2
  exit 1
fi
sed 's/^/  [server] /' "$log"
"$build_dir/client/gradwire" info --server "$addr"
"$build_dir/client/gradwire" demo --server "$addr" "$@"
kill -TERM "$pid"
wait "$pid"
sed 's/^/  [server] /' "$log" | tail -3
trap 'rm -f "$log"' EXIT
