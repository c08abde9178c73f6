#!/usr/bin/env bash
# Builds the `cpu` image, runs the server container on the host network, runs `gradwire demo` and
# `gradwire health` against it (from a second container of the same image), checks the image's
# HEALTHCHECK and that it runs as a non-root user, and cleans up. Exits non-zero on any failure.
#   usage: deploy/test-image.sh [--keep-image]
# Uses podman or docker, whichever is present (on a machine without either, see
# ../shared/scripts/container-base.sh for a podman set-up with a local debian:bookworm-slim).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
keep_image=0
for arg in "$@"; do
  case $arg in
    --keep-image) keep_image=1 ;;
    -h | --help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "test-image: unknown argument $arg" >&2; exit 2 ;;
  esac
done
if command -v podman >/dev/null; then
  engine=podman
  build_flags=(--format docker)  # keeps HEALTHCHECK (the OCI format drops it)
  # Podman schedules health checks with systemd timers; without systemd, run them by hand.
  once_flags=(--no-healthcheck)
  server_flags=(--health-interval=disable)
elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  engine=docker
  build_flags=()
  once_flags=(--no-healthcheck)
  server_flags=()
else
  echo "test-image: neither podman nor a running docker engine found" >&2
  exit 1
fi
image=gradwire:cpu-test-$$
name=gradwire-test-$$
port=$((20000 + RANDOM % 20000))
# shellcheck source=SCRIPTDIR/../scripts/lib/check.sh
source "$root/scripts/lib/check.sh"
cleanup_more() {
  $engine rm -f "$name" >/dev/null 2>&1 || true
  if [ "$keep_image" = 0 ]; then $engine rmi -f "$image" >/dev/null 2>&1 || true; fi
}

echo "test-image: building the cpu target with $engine (the first build takes several minutes)"
start=$(date +%s)
$engine build "${build_flags[@]}" --target cpu -t "$image" "$root" 2>&1 | sed 's/^/  build: /' | tail -n 15
check "image builds" bash -c "$engine image inspect '$image' >/dev/null"
echo "test-image: built in $(($(date +%s) - start)) s; size $($engine image inspect "$image" --format '{{.Size}}' | awk '{printf "%.0f MiB", $1/1048576}')"

check "runs as a non-root user" \
  bash -c "[ \"\$($engine run --rm ${once_flags[*]} --entrypoint id '$image' -u)\" = 10001 ]"
check "only the runtime stage's files: no compiler in the image" \
  bash -c "! $engine run --rm ${once_flags[*]} --entrypoint sh '$image' -c 'command -v c++ || command -v cmake' >/dev/null"
check "gradwire-server --help works" \
  bash -c "$engine run --rm ${once_flags[*]} '$image' --help | grep 'gradwire-server' >/dev/null"

$engine run -d "${server_flags[@]}" --name "$name" --network host -e "GRADWIRE_SERVER_LISTEN=127.0.0.1:$port" \
  "$image" --log-level info >/dev/null 2>"$tmp/run.err" || { cat "$tmp/run.err"; exit 1; }
# (its stderr is shown only on failure: podman without systemd complains there about health-check timers)
for _ in $(seq 1 100); do
  if $engine logs "$name" 2>&1 | grep -q 'listening on'; then break; fi
  sleep 0.2
done
check "server container starts" bash -c "$engine logs '$name' 2>&1 | grep -q 'listening on 127.0.0.1:$port'"
cli() { $engine run --rm "${once_flags[@]}" --network host --entrypoint gradwire "$image" "$@"; }
check "gradwire health: SERVING" \
  bash -c "$engine run --rm ${once_flags[*]} --network host --entrypoint gradwire '$image' health --server 127.0.0.1:$port | grep -qx SERVING"
demo_out=$(cli demo --server "127.0.0.1:$port" --steps 100 --json 2>/dev/null | tail -n 1 || true)
echo "  demo: $demo_out"
check "gradwire demo trains (final loss < half the initial)" \
  python3 -c "import json,sys; r=json.loads(sys.argv[1]); sys.exit(0 if r['final_loss'] < 0.5*r['initial_loss'] else 1)" "$demo_out"
if [ "$engine" = podman ]; then
  load_out=$($engine run --rm "${once_flags[@]}" --network host \
  --entrypoint gradwire-load "$image" --server "127.0.0.1:$port" --flow step --rows 8 --in 64 \
  --out 32 --count 50 --warmup 0.2 --json - 2>/dev/null || true)
check "gradwire-load runs 50 steps against it" \
  python3 -c "import json,sys; r=json.loads(sys.argv[1]); sys.exit(0 if r['runs'][0]['ok'] == 50 else 1)" "$load_out"
check "the image's HEALTHCHECK passes" $engine healthcheck run "$name"
else
  sleep 12
  check "the image's HEALTHCHECK passes" \
    bash -c "[ \"\$(docker inspect -f '{{.State.Health.Status}}' '$name')\" = healthy ]"
fi
$engine stop -t 20 "$name" >/dev/null 2>&1
check "SIGTERM: the server exits 0" \
  bash -c "[ \"\$($engine inspect -f '{{.State.ExitCode}}' '$name')\" = 0 ]"
check "the log says it stopped cleanly" bash -c "$engine logs '$name' 2>&1 | grep -q 'stopped:'"

finish test-image
