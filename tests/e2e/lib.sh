# Shared by the end-to-end scripts (sourced): a temp dir, a check() counter, start_server and the
# closing summary. Expects $server_bin; sets $tmp, $server_pid and $addr.
tmp=$(mktemp -d)
server_pid=""
cleanup() {
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
start_server() {
  "$server_bin" "$@" >"$tmp/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 100); do
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
finish() {
  echo "e2e: $passed passed, $failed failed"
  [ "$failed" = 0 ]
}
