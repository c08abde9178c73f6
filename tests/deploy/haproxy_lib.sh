# shellcheck shell=bash
# Sourced by the tests that run gradwire-servers behind HAProxy on loopback
# (tests/deploy/haproxy_check.sh, tests/e2e/proxy_e2e.sh), after scripts/lib/check.sh and with
# $server_bin, $python and $tmp set. Gives:
#   free_port      a free TCP port on 127.0.0.1
#   start_one N [ADDRESS]
#                  gradwire-server N on ADDRESS (default 127.0.0.1 and a free port; its address
#                  in $tmp/portN, its pid in ${server_pids[N]}), with the flags in
#                  ${server_flags[@]} besides; killed at exit with everything else in $pids
#   start_cluster  servers 1 to 3 (start_one) and HAProxy with deploy/haproxy/haproxy.cfg in
#                  front of them (needs $root): its address in $proxy, its stats page in $admin
#   states         the servers' states from HAProxy's stats page at $admin:
#                  "gradwire-1=UP gradwire-2=UP gradwire-3=DOWN"
#   wait_states W  up to 15 s for states to read W
pids=()
declare -A server_pids
[ -n "${server_flags+x}" ] || server_flags=()
cleanup_more() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null && wait "$p" 2>/dev/null; done; true; }
free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
start_one() {
  rm -f "$tmp/port$1"
  "$server_bin" --listen "${2:-127.0.0.1:0}" --port-file "$tmp/port$1" --cpu-threads 1 \
    --shared-memory off "${server_flags[@]}" >>"$tmp/server$1.log" 2>&1 &
  pids+=($!)
  server_pids[$1]=$!
  for _ in $(seq 1 100); do [ -s "$tmp/port$1" ] && return 0; sleep 0.1; done
  echo "server $1 did not start:"; cat "$tmp/server$1.log"; exit 1
}
start_cluster() {
  for n in 1 2 3; do start_one "$n"; done
  proxy=127.0.0.1:$(free_port)
  admin=127.0.0.1:$(free_port)
  GRADWIRE_SERVER_1=$(cat "$tmp/port1") GRADWIRE_SERVER_2=$(cat "$tmp/port2") \
    GRADWIRE_SERVER_3=$(cat "$tmp/port3") GRADWIRE_PROXY_LISTEN=$proxy GRADWIRE_PROXY_ADMIN=$admin \
    haproxy -f "$root/deploy/haproxy/haproxy.cfg" -db >"$tmp/haproxy.log" 2>&1 &
  pids+=($!)
}
states() {
  "$python" - "$admin" <<'PY'
import csv, io, sys, urllib.request
rows = csv.DictReader(io.StringIO(urllib.request.urlopen("http://%s/stats;csv" % sys.argv[1], timeout=3).read().decode().lstrip("# ")))
print(" ".join("%s=%s" % (r["svname"], r["status"]) for r in rows if r["pxname"] == "gradwire" and r["svname"].startswith("gradwire-")))
PY
}
wait_states() {
  for _ in $(seq 1 75); do
    [ "$(states 2>/dev/null)" = "$1" ] && return 0
    sleep 0.2
  done
  echo "  states: $(states 2>&1 || true), wanted: $1"
  return 1
}
