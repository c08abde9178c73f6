# shellcheck shell=bash
# Sourced by the scripts that run checks and count them (tests/e2e/*.sh, tests/deploy/validate.sh,
# deploy/test-image.sh) and by scripts/soak.sh. Gives:
#   $tmp            a temp dir, removed on exit (after a kill -9 of $server_pid if that still runs);
#                   a script with more to clean up defines cleanup_more(), which runs first
#   check           check NAME COMMAND...: runs COMMAND, prints "ok   NAME" or "FAIL NAME", counts
#   start_server    starts $server_bin (gradwire-server) with the given flags; sets $server_pid, $addr
#   stop_server     SIGTERM, and a check that it exits 0
#   finish          finish [LABEL]: "LABEL: N passed, M failed" (LABEL e2e by default); fails when
#                   a check failed
tmp=$(mktemp -d)
server_pid=""
cleanup() {
  if declare -F cleanup_more >/dev/null; then cleanup_more || true; fi
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then kill -9 "$server_pid"; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
passed=0
failed=0
check() {  # check NAME CONDITION-COMMAND...
  local name=$1
  shift
  if "$@"; then
    passed=$((passed + 1))
    echo "ok   $name"
  else
    failed=$((failed + 1))
    echo "FAIL $name"
  fi
}

# Starts gradwire-server with the given flags, waits for its "listening on" line, sets $addr.
# The log is emptied here, before the launch: the child's own `>` truncation happens whenever the
# forked shell gets to it, and until then a restart would read the previous server's "listening
# on" line.
start_server() {
  : >"$tmp/server.log"
  # shellcheck disable=SC2154  # $server_bin: set by the script that sources this
  "$server_bin" "$@" >>"$tmp/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 300); do
    if grep -q 'listening on' "$tmp/server.log"; then break; fi
    if ! kill -0 "$server_pid" 2>/dev/null; then break; fi
    sleep 0.1
  done
  addr=$(sed -n 's/.*listening on \([^" ]*\).*/\1/p' "$tmp/server.log" | head -1)
  [ -n "$addr" ] || { echo "server did not start:"; cat "$tmp/server.log"; exit 1; }
}

# Stops the server with SIGTERM and checks that it exits 0.
stop_server() {
  kill -TERM "$server_pid"
  local rc=0
  wait "$server_pid" || rc=$?
  server_pid=""
  check "SIGTERM: exit 0" [ "$rc" = 0 ]
}

# Prints the summary line and fails the script when any check failed.
# shellcheck disable=SC2120  # the label is optional
finish() {
  echo "${1:-e2e}: $passed passed, $failed failed"
  [ "$failed" = 0 ]
}
