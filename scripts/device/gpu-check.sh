#!/usr/bin/env bash
# The server's CUDA backend end to end on a GPU machine (nvcc, CMake, Ninja, python3 with CUDA
# torch), most valuable result first, in a first device call of about 5 minutes that leaves room
# for a second. Here, after the last commit: scripts/device/deps.sh (it packs .device-deps/ and
# records the commit). Then, from the repo root:
#
#   device run, carry [".device-deps"], timeout_s 440:   scripts/device/gpu-check.sh
#   at once, on the warm machine (its build is kept):     GW_CHECK_STEPS=second scripts/device/gpu-check.sh
#
#   0. configure and build only the targets below (Release, sm_90, build-gpucheck/)
#   1. the parity harness's CUDA rows against the reference: nothing may fail or skip
#   2. the service suites with GRADWIRE_TEST_DEVICE=cuda, in parallel, and the kernel tests
#   3. the demo (Linear, --model mlp) through a real server on cpu and on cuda: final losses 5 %
#   4. the server step over loopback next to the in-process step (both on the GPU), over gRPC
#      and through shared memory, then the FP8 GEMM and module benchmark next to PyTorch, the
#      host copies, the step breakdown (with the copy stream and without) and batching. A second
#      call: pinned staging, the step with FP8 and with bf16 on the wire.
#
# Every step has a timeout inside one budget (GW_CHECK_BUDGET_S, 400 s; the build's own limit is
# GW_CHECK_BUILD_S, 360 s: raise both for a first build on a small machine), and after every step
# $OUT/cuda-stage2.json is rewritten with everything so far, so a run that is cut off still
# returns what ran. $OUT (default build-gpucheck/out) gets six files:
#   progress.log      one line per step as it finishes
#   cuda-stage2.json  the results and the targets (commit it as a new docs/perf/cuda-*.json);
#                     "complete": false when the run was cut off
#   build.log         configure and build: the architecture flags, errors, the tail
#   tests.log         failures, skip reasons and the kernel tests' [ measured ] lines
#   bench.txt         the benchmark tables
#   logs.tar.gz       every step's whole log and the servers' logs (packed again after each step
#                     that did not pass, and at the end)
# The CPU suites are not run here: CI runs them. Without a GPU (a rehearsal) every step still
# runs and says why it could not; a CUDA row that skips counts as a failure.
# Exit status: 0 when parity, the service suites, the kernel tests and the demo met their targets.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

budget=${GW_CHECK_BUDGET_S:-400}
t0=$(date +%s)
deadline=$((t0 + budget))
build=${GW_CHECK_BUILD:-build-gpucheck}
out=${OUT:-$build/out}
work=$build/work
mkdir -p "$out" "$work"
out=$(cd "$out" && pwd)
rm -f "$work"/* "$out"/progress.log "$out"/tests.log "$out"/bench.txt "$out"/build.log \
  "$out"/logs.tar.gz
json=$out/cuda-stage2.json
py=python3

elapsed() { echo $(($(date +%s) - t0)); }
left() { echo $((deadline - $(date +%s))); }
say() {  # a progress line, to stdout and $OUT/progress.log
  printf '[%4ss] %s\n' "$(elapsed)" "$*" | tee -a "$out/progress.log"
}
report() {
  "$py" scripts/device/gpu_check_report.py "$work" "$json" "$@" 2>> "$out/progress.log" ||
    say "report: could not write $json"
}
# pack_logs: every file of the work folder (each step's whole log, the servers' logs, the status
# and result files) into $OUT/logs.tar.gz, so that a failure's whole output comes back, not only
# tests.log's excerpt. A file over 2 MiB keeps its first and last MiB; the archive stays under
# the 16 MiB a returned file may have (over 15 MiB, each file keeps 128 KiB at each end).
pack_logs() {
  local pack=$build/logs-pack each=1048576 f n
  for each in 1048576 131072; do
    rm -rf "$pack"
    mkdir -p "$pack/logs"
    for f in "$work"/*; do
      [ -f "$f" ] || continue
      n=$pack/logs/$(basename "$f")
      if [ "$(stat -c %s "$f")" -le $((2 * each)) ]; then
        cp "$f" "$n"
      else
        { head -c "$each" "$f"; printf '\n[... cut by gpu-check: %s bytes in all ...]\n' \
            "$(stat -c %s "$f")"; tail -c "$each" "$f"; } > "$n"
      fi
    done
    tar -C "$pack" -czf "$out/logs.tar.gz.tmp" logs 2>/dev/null || break
    [ "$(stat -c %s "$out/logs.tar.gz.tmp")" -gt $((15 * 1048576)) ] || break
  done
  [ -f "$out/logs.tar.gz.tmp" ] && mv -f "$out/logs.tar.gz.tmp" "$out/logs.tar.gz"
  rm -rf "$pack"
}
step_done() {  # step_done NAME STATUS STARTED [NOTE]: record a step and rewrite the report
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$(($(date +%s) - $3))" "${4:-}" >> "$work/steps.tsv"
  say "$1: $2${4:+ ($4)} in $(($(date +%s) - $3)) s"
  report
  [ "$2" = ok ] || pack_logs  # a cut-off run still returns the logs of what failed
}
# cap WANT [RESERVE]: WANT seconds, or less so that RESERVE seconds are left for what follows.
cap() {
  local l=$(($(left) - ${2:-0}))
  if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi
}
# run SECONDS LOG CMD...: CMD under timeout (its whole process group), in the background so a
# signal to this script reaches its trap at once. Returns CMD's status; 124: timed out.
run() {
  local secs=$1 log=$2
  shift 2
  if [ "$secs" -le 0 ]; then
    echo "not run: no time left in the budget" > "$log"
    return 124
  fi
  timeout -k 5 "$secs" "$@" > "$log" 2>&1 &
  wait $!
}
# tests_excerpt TITLE LOG: what a test log says about failures and skips, into tests.log.
tests_excerpt() {
  {
    echo "=== $1"
    grep -E '^\[  FAILED  \].*\([0-9]+ ms\)$' "$2" | head -n 40
    grep -B1 -A12 -E '(Failure|error: )' "$2" | head -n 80
    grep -A1 -E ': Skipped$' "$2" | grep -v -E ': Skipped$|^--$' | sort | uniq -c | head -n 5
    grep -E 'Abort|terminate called|what\(\)|Segmentation|GRADWIRE_TEST_DEVICE' "$2" | head -n 5
    grep -E '^\[ redrawn  \]' "$2" | head -n 20
  } >> "$out/tests.log"
}

stop_server() {  # stop_server PID: TERM, a moment to drain, then KILL
  kill "$1" 2>/dev/null || return 0
  for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$1" 2>/dev/null || break; sleep 0.3; done
  kill -9 "$1" 2>/dev/null
  wait "$1" 2>/dev/null
  return 0
}
# start_server NAME DEVICE [FLAGS...]: a server on 127.0.0.1:0, started here in this shell (not
# in a $(...) subshell, which would lose its pid). Sets server_pid and server_addr; returns 1 when
# it exits or does not serve within 30 s (the reason is in $work/server-NAME.log).
start_server() {
  local name=$1 device=$2
  shift 2
  rm -f "$work/port-$name"
  "$build/server/gradwire-server" --listen 127.0.0.1:0 --port-file "$work/port-$name" \
    --device "$device" --shutdown-grace 1 --heap-trim-every 0 "$@" > "$work/server-$name.log" 2>&1 &
  server_pid=$!
  server_addr=""
  for _ in $(seq 150); do
    if [ -s "$work/port-$name" ]; then
      server_addr=$(cat "$work/port-$name")
      return 0
    fi
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.2
  done
  stop_server "$server_pid"
  return 1
}
descendants() {  # every process below $1, children first listed before theirs
  local c
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    echo "$c"
    descendants "$c"
  done
}
finish() {
  local rc=$? p left_over
  trap - EXIT TERM INT HUP
  # Whatever still runs (a server, a step cut off by a signal, a subshell's timeout): TERM, a
  # moment, then KILL. Only this script's own descendants, by pid.
  left_over=$(descendants $$)
  for p in $left_over; do kill "$p" 2>/dev/null; done
  [ -z "$left_over" ] || sleep 1
  for p in $left_over; do kill -9 "$p" 2>/dev/null; done
  pack_logs
  echo "gpu-check: targets (all results in $json):"
  if [ "$reached_end" = 1 ]; then report --final --print; else report --print; fi
  say "done in $(elapsed) s, exit status $rc"
  exit "$rc"
}
# The steps after the build. A first call runs the checks and the figures the report needs (the
# one-stream breakdown is the only measure of the copy stream's overlap); the comparisons after
# them (pinned staging, FP8 and bf16 on the wire) are for a second call, which a warm machine
# starts with its build done: GW_CHECK_STEPS="second" (or any names below, or "all").
first_steps="parity service demo server-step server-step-shm cuda-bench host-copies step-breakdown
  step-breakdown-one-stream batching"
second_steps="staging server-step-fp8 server-step-bf16"
case "${GW_CHECK_STEPS:-first}" in
  first) steps_asked=$first_steps ;;
  second) steps_asked=$second_steps ;;
  all) steps_asked="$first_steps $second_steps" ;;
  *) steps_asked=$GW_CHECK_STEPS ;;
esac
steps_asked=$(echo $steps_asked)  # one line, single spaces
# want STEP: whether the steps asked for name it.
want() { [[ " $steps_asked " == *" $1 "* ]]; }
reached_end=0  # "complete" in the JSON: every step had its turn
trap finish EXIT
trap 'say "stopped by a signal"; exit 143' TERM INT HUP

# --- The machine ------------------------------------------------------------------------------
started=$(date +%s)
say "gpu-check: budget ${budget} s, build dir $build, results in $out"
say "steps: $steps_asked"
known=" $(echo $first_steps $second_steps) "
for s in $steps_asked; do
  [[ "$known" == *" $s "* ]] || say "WARNING: no step is called $s"
done
if ! ls .device-deps/*.deb > /dev/null 2>&1 && [ ! -d /opt/gwdeps/usr ]; then
  say "WARNING: no .device-deps/ (scripts/device/deps.sh here, then carry it): gRPC, protobuf," \
    "spdlog and GoogleTest must then come from this machine"
fi
# shellcheck disable=SC1091
source scripts/device/env.sh > "$work/env.log" 2>&1
cat "$work/env.log" >> "$out/progress.log"
{
  echo "started_epoch=$t0"
  echo "hostname=$(hostname)"
  echo "cores=$(nproc)"
  echo "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
  echo "memory_gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)"
  echo "os=$(sed -n 's/^PRETTY_NAME="*\([^"]*\)"*$/\1/p' /etc/os-release 2>/dev/null), $(uname -r)"
  echo "steps_asked=$steps_asked"
  echo "nvcc=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  # deps.sh records the commit here before the call; the device copy's .git can be older.
  if [ -s .device-deps/commit ]; then
    echo "commit=$(cat .device-deps/commit)"
    echo "tree_changes=$(cat .device-deps/tree_changes 2>/dev/null || echo unknown)"
    # Files that differ from the tree deps.sh hashed: nonzero means a change after deps.sh ran.
    if [ -s .device-deps/manifest ]; then
      echo "files_changed_since_deps=$(sha1sum -c --quiet .device-deps/manifest 2>/dev/null |
        grep -c -v '^sha1sum:')"
    fi
  else
    echo "commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "tree_changes=$(git status --porcelain 2>/dev/null | wc -l)"
  fi
} > "$work/machine.txt"
if nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit \
  --format=csv > "$work/gpu.csv" 2> "$work/gpu.err"; then
  say "gpu: $(tail -n +2 "$work/gpu.csv" | head -n 1)"
else
  rm -f "$work/gpu.csv"
  echo "no_gpu=nvidia-smi: $(head -c 200 "$work/gpu.err" | tr '\n' ' ')" >> "$work/machine.txt"
  say "NO GPU on this machine (nvidia-smi failed): every CUDA row and step below will fail"
fi
# The PyTorch side (and its CUDA and C++ ABI) from the python whose torch CMake uses.
tpy=${TORCH_PYTHON:-python3}
timeout 60 "$tpy" - > "$work/torch.txt" 2>&1 <<'PY' &
import torch
print("torch=" + torch.__version__)
print("cuda=" + str(torch.version.cuda))
print("available=" + str(torch.cuda.is_available()))
print("cxx11_abi=" + str(torch._C._GLIBCXX_USE_CXX11_ABI))
PY
torch_pid=$!
stale=$(sed -n 's/^files_changed_since_deps=//p' "$work/machine.txt")
if [ "${stale:-0}" != 0 ]; then
  say "WARNING: $stale files differ from the tree scripts/device/deps.sh recorded: the report's" \
    "commit does not name what runs here (run deps.sh after the last commit)"
fi
step_done machine ok "$started"

# --- 0. Build only what runs ------------------------------------------------------------------
mapfile -t suites < <(sed -n 's/^gradwire_service_test(\([a-z0-9_]*\).*/\1/p' \
  tests/service/CMakeLists.txt)
kernel_tests=(kernels_test cuda_host_test cuda_kernels_test cuda_kernels_vs_core_test)
targets=(gradwire-server gradwire gradwire-load backend_parity_test "${suites[@]}"
  "${kernel_tests[@]}" gradwire-cuda-bench step_breakdown core_test)
# shellcheck disable=SC2206  # GW_CHECK_TARGETS: a space-separated subset, split on purpose
[ -z "${GW_CHECK_TARGETS:-}" ] || targets=(${GW_CHECK_TARGETS})
started=$(date +%s)
rm -f "$build/CMakeCache.txt"  # a fresh configure; objects already built are kept
# GoogleTest discovery at test time, not after each link: nothing here runs ctest.
# shellcheck disable=SC2086  # GW_CMAKE_ARGS: extra arguments, split on purpose
run "$(cap 180 330)" "$work/configure.log" cmake -S . -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DGRADWIRE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGRADWIRE_E2E_TESTS=OFF -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST \
  -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" ${GW_CMAKE_ARGS:-}
configure_rc=$?
configure_s=$(($(date +%s) - started))
torch_dir=$(sed -n 's/^Torch_DIR:PATH=//p' "$build/CMakeCache.txt" 2>/dev/null)
{
  echo "=== configure (rc $configure_rc, ${configure_s} s)"
  grep -E 'CUDA|Torch|torch|arch|gencode|gradwire|Warning|Error|error' "$work/configure.log" |
    head -n 40
  echo "--- tail"
  tail -n 15 "$work/configure.log"
} >> "$out/build.log"
if [ "$configure_rc" != 0 ]; then
  printf 'configure_rc=%s\nconfigure_s=%s\n' "$configure_rc" "$configure_s" > "$work/build.txt"
  step_done configure "FAILED rc $configure_rc" "$started" "see build.log"
  exit 1
fi
step_done configure ok "$started" "Torch_DIR $torch_dir"

started=$(date +%s)
# -k 0: a target that fails to build does not keep the others from building and running.
run "$(cap "${GW_CHECK_BUILD_S:-360}" 150)" "$work/build.log" cmake --build "$build" -j "$(nproc)" \
  --target "${targets[@]}" -- -k 0
build_rc=$?
build_s=$(($(date +%s) - started))
built=() missing=()
for t in "${targets[@]}"; do
  f=$(find "$build" -name "$t" -type f -perm -u+x -not -path '*/CMakeFiles/*' 2>/dev/null |
    head -n 1)
  if [ -n "$f" ]; then built+=("$t"); else missing+=("$t"); fi
done
# The CUDA arch flags nvcc got, and whether the test binaries load libtorch's CUDA library (the
# CUDA backend answers UNAVAILABLE when libtorch has no CUDA).
arch_flags=$(grep -o -E -- '(-gencode[= ][^ ]+|--generate-code=[^ ]+|-arch[= ][^ ]+)' \
  "$build/compile_commands.json" 2>/dev/null | sort -u | tr '\n' ' ')
libtorch_cuda=$(ldd "$build/tests/core/backend_parity_test" 2>/dev/null | grep -c 'libtorch_cuda')
cudart=$(ldd "$build/tests/core/backend_parity_test" 2>/dev/null |
  grep -o 'libcudart[^ ]* => [^ ]*' | head -n 1)
{
  echo "configure_rc=$configure_rc"
  echo "configure_s=$configure_s"
  echo "build_rc=$build_rc"
  echo "build_s=$build_s"
  echo "jobs=$(nproc)"
  echo "torch_dir=$torch_dir"
  echo "cuda_architectures=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' \
    "$build/CMakeCache.txt")"
  echo "cuda_arch_flags=$arch_flags"
  echo "links_libtorch_cuda=$([ "${libtorch_cuda:-0}" -gt 0 ] && echo yes || echo no)"
  echo "cudart=$cudart"
  echo "built=${built[*]}"
  echo "missing=${missing[*]}"
} > "$work/build.txt"
{
  echo "=== build (rc $build_rc, ${build_s} s, -j $(nproc)); missing: ${missing[*]:-none}"
  echo "cuda arch flags: $arch_flags"
  echo "backend_parity_test links libtorch_cuda: ${libtorch_cuda:-0}; $cudart"
  grep -E 'error|FAILED:' "$work/build.log" | head -n 40
  echo "--- tail"
  tail -n 25 "$work/build.log"
} >> "$out/build.log"
if [ "$build_rc" = 0 ]; then
  step_done build ok "$started" "${#built[@]} targets, -j $(nproc)"
else
  step_done build "FAILED rc $build_rc" "$started" "missing: ${missing[*]:-none}"
fi
wait "$torch_pid" 2>/dev/null
say "torch: $(tr '\n' ' ' < "$work/torch.txt" | head -c 300)"
if grep -q '^available=True' "$work/torch.txt" && [ "${libtorch_cuda:-0}" = 0 ]; then
  say "WARNING: torch has CUDA but backend_parity_test does not load libtorch_cuda: the CUDA" \
    "backend will answer UNAVAILABLE (was the link --as-needed?)"
fi
report

# --- 1. The parity harness, CUDA rows only (the CPU rows are CI's) ----------------------------
started=$(date +%s)
if ! want parity; then
  say "parity: not asked for (GW_CHECK_STEPS)"
elif [ -x "$build/tests/core/backend_parity_test" ]; then
  run "$(cap 120 110)" "$work/parity.log" "$build/tests/core/backend_parity_test" \
    --gtest_filter='*/cuda*:CudaBackendAvailability.*' --gtest_color=no
  echo $? > "$work/parity.rc"
  tests_excerpt parity "$work/parity.log"
  c=$(grep -c -E '^\[       OK \]' "$work/parity.log")
  f=$(grep -c -E '^\[  FAILED  \].*\([0-9]+ ms\)$' "$work/parity.log")
  s=$(grep -c -E '^\[  SKIPPED \].*\([0-9]+ ms\)$' "$work/parity.log")
  r=$(grep -c -E '^\[ redrawn  \]' "$work/parity.log")
  status=ok
  [ "$(cat "$work/parity.rc")" = 0 ] && [ "$f" = 0 ] && [ "$s" = 0 ] || status=FAILED
  step_done parity "$status" "$started" \
    "$c passed, $f failed, $s skipped, $r module draws repeated, rc $(cat "$work/parity.rc")"
  # A failure: the same rows once more with the wire copies on the compute stream
  # (GRADWIRE_CUDA_COPY_STREAM=0), which tells a copy-stream ordering fault from the rest.
  if [ "$status" = FAILED ]; then
    started=$(date +%s)
    GRADWIRE_CUDA_COPY_STREAM=0 run "$(cap 60 110)" "$work/parity-one-stream.log" \
      "$build/tests/core/backend_parity_test" \
      --gtest_filter='*/cuda*:CudaBackendAvailability.*' --gtest_color=no
    echo $? > "$work/parity-one-stream.rc"
    tests_excerpt "parity, copies on the compute stream" "$work/parity-one-stream.log"
    step_done parity-one-stream "rc $(cat "$work/parity-one-stream.rc")" "$started" \
      "$(grep -c -E '^\[       OK \]' "$work/parity-one-stream.log") passed, $(grep -c -E \
        '^\[  FAILED  \].*\([0-9]+ ms\)$' "$work/parity-one-stream.log") failed"
  fi
else
  step_done parity "not built" "$started"
fi

# --- 2. The service suites on the CUDA backend, and the kernel tests, all at once --------------
started=$(date +%s)
if want service; then
  secs=$(cap 120 40)
  pids=()
  names=()
  for t in "${suites[@]}"; do
    [ -x "$build/tests/service/$t" ] || continue
    (
      export GRADWIRE_TEST_DEVICE=cuda
      run "$secs" "$work/svc-$t.log" "$build/tests/service/$t" --gtest_color=no
      echo $? > "$work/svc-$t.rc"
    ) 2> /dev/null &  # bash's "Aborted" job notices; the log has the test's own output
    pids+=($!)
    names+=("$t")
  done
  for t in "${kernel_tests[@]}"; do
    bin=$(find "$build/tests" -name "$t" -type f -perm -u+x -not -path '*/CMakeFiles/*' | head -n 1)
    [ -n "$bin" ] || continue
    (
      run "$secs" "$work/kt-$t.log" "$bin" --gtest_color=no
      echo $? > "$work/kt-$t.rc"
    ) 2> /dev/null &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  svc_fail=0
  for t in "${names[@]}"; do
    rc=$(cat "$work/svc-$t.rc" 2>/dev/null || echo "?")
    f=$(grep -c -E '^\[  FAILED  \].*\([0-9]+ ms\)$' "$work/svc-$t.log")
    if [ "$rc" != 0 ] || [ "$f" != 0 ]; then
      svc_fail=$((svc_fail + 1))
      tests_excerpt "service $t (rc $rc)" "$work/svc-$t.log"
    fi
  done
  for t in "${kernel_tests[@]}"; do
    [ -f "$work/kt-$t.log" ] || continue
    rc=$(cat "$work/kt-$t.rc" 2>/dev/null || echo "?")
    if [ "$rc" != 0 ] || grep -q -E '^\[  SKIPPED \]' "$work/kt-$t.log"; then
      tests_excerpt "kernel test $t (rc $rc)" "$work/kt-$t.log"
    fi
    if grep -q -E '^\[ measured \]' "$work/kt-$t.log"; then
      { echo "=== $t [ measured ]"; grep -E '^\[ measured \]' "$work/kt-$t.log"; } >> "$out/tests.log"
    fi
  done
  passed=$(cat "$work"/svc-*.log 2>/dev/null | grep -c -E '^\[       OK \]')
  step_done service "$([ "$svc_fail" = 0 ] && [ "${#names[@]}" -gt 0 ] && echo ok || echo FAILED)" \
    "$started" "${#names[@]} suites, $svc_fail failing or skipping, $passed tests passed"
  # The kernel tests ran beside the suites: a step of their own, so that a failing or skipping
  # one changes a status and the exit code, not only a row of the JSON.
  kt_n=0 kt_fail=0
  for t in "${kernel_tests[@]}"; do
    [ -f "$work/kt-$t.log" ] || continue
    kt_n=$((kt_n + 1))
    rc=$(cat "$work/kt-$t.rc" 2>/dev/null || echo "?")
    if [ "$rc" != 0 ] || grep -q -E '^\[  (FAILED|SKIPPED) \].*\([0-9]+ ms\)$' "$work/kt-$t.log"; then
      kt_fail=$((kt_fail + 1))
    fi
  done
  passed=$(cat "$work"/kt-*.log 2>/dev/null | grep -c -E '^\[       OK \]')
  step_done kernel-tests "$([ "$kt_fail" = 0 ] && [ "$kt_n" = "${#kernel_tests[@]}" ] && echo ok ||
    echo FAILED)" "$started" \
    "$kt_n of ${#kernel_tests[@]} built, $kt_fail failing or skipping, $passed tests passed"
fi

# --- 3. The demo through a real server, CPU and CUDA side by side -----------------------------
started=$(date +%s)
if ! want demo; then
  say "demo: not asked for (GW_CHECK_STEPS)"
elif [ -x "$build/server/gradwire-server" ] && [ -x "$build/client/gradwire" ]; then
  secs=$(cap 60 0)
  pids=()
  for model in linear mlp; do
    for device in cpu cuda; do
      (
        if start_server "demo-$model-$device" "$device"; then
          timeout -k 5 "$secs" "$build/client/gradwire" demo --server "$server_addr" \
            --model "$model" --json > "$work/demo-$model-$device.json" \
            2> "$work/demo-$model-$device.log"
          echo "demo rc $?" >> "$work/demo-$model-$device.log"
          stop_server "$server_pid"
        else
          echo "the $device server did not start:" \
            "$(tail -n 3 "$work/server-demo-$model-$device.log")" > "$work/demo-$model-$device.log"
        fi
      ) &
      pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for f in "$work"/demo-*.log; do
    echo "=== $(basename "$f" .log): $(tail -n 2 "$f" | tr '\n' ' ')" >> "$out/tests.log"
  done
  verdict=$("$py" - "$work" <<'PY'
import json, sys
def loss(model, device):
    try:
        text = open(f"{sys.argv[1]}/demo-{model}-{device}.json").read().strip().splitlines()
        return json.loads(text[-1])["final_loss"]
    except Exception:
        return None
parts, ok = [], True
for model in ("linear", "mlp"):
    cpu, gpu = loss(model, "cpu"), loss(model, "cuda")
    if cpu is None or gpu is None:
        ok = False
        parts.append(f"{model} cpu {cpu} cuda {gpu}")
    else:
        ok &= abs(gpu - cpu) <= 0.05 * abs(cpu)
        parts.append(f"{model} cpu {cpu:.5f} cuda {gpu:.5f} ({100 * (gpu - cpu) / cpu:+.1f}%)")
print(("ok" if ok else "FAILED") + "\t" + ", ".join(parts))
PY
)
  step_done demo "${verdict%%$'\t'*}" "$started" "${verdict#*$'\t'}"
else
  step_done demo "not built" "$started"
fi

# --- 4. Benchmarks ------------------------------------------------------------------------------
# The server step first: next to the in-process step on the GPU it has never been measured, the
# GEMM has. Linear 4096 -> 4096, 8192 rows: 128 MiB of f32 each way per call, over the 64 MiB
# default message limits, hence the larger limits on both ends.
#
# server_step NAME WIRE SECONDS [shm]: gradwire-load against a fresh --device cuda server, the
# wire carrying WIRE (f32: the issue's figure; fp8: a quarter of the bytes, for comparison); with
# shm the tensors go through POSIX shared memory instead of the gRPC messages; with staged the
# server and the in-process baseline move them through pinned staging (--cuda-staging-mib 8).
server_step() {
  local name=$1 wire=$2 secs=$3 rc started
  # Over gRPC unless asked: the load tool would pick shared memory by itself on this host.
  local server_flags=() load_flags=(--shared-memory off)
  case "${4:-}" in
    shm)  # regions the server makes for the load tool's workers (on by default for loopback)
      load_flags=(--shared-memory on)
      ;;
    staged)  # the server and the in-process baseline with 8 MiB pinned staging
      server_flags=(--cuda-staging-mib 8)
      load_flags=(--shared-memory off --cuda-staging-mib 8)
      ;;
  esac
  started=$(date +%s)
  if [ ! -x "$build/client/gradwire-load" ] || [ ! -x "$build/server/gradwire-server" ]; then
    step_done "$name" "not built" "$started"
    return
  fi
  if ! start_server "$name" cuda --max-message-mib 512 --max-request-bytes 512MiB \
    "${server_flags[@]}"; then
    echo "the cuda server did not start: $(tail -n 3 "$work/server-$name.log")" >> "$out/bench.txt"
    step_done "$name" FAILED "$started" "the cuda server did not start (bench.txt says why)"
    return
  fi
  run "$secs" "$work/$name.log" "$build/client/gradwire-load" --server "$server_addr" \
    --max-message-mib 512 --timeout 60 --kind linear --in 4096 --out 4096 --rows 8192 \
    --wire-dtype "$wire" --flow step --concurrency 1 --warmup 2 --duration 8 --baselines \
    --baseline-device cuda "${load_flags[@]}" --json "$work/$name.json"
  rc=$?
  stop_server "$server_pid"
  {
    echo "=== $name: server step, wire $wire (gradwire-load, rc $rc)"
    tr '\r' '\n' < "$work/$name.log" |
      grep -E '^(mode|remote|in-process|empty-rpc|ratios|server after|gradwire-load)' | tail -n 12
  } >> "$out/bench.txt"
  step_done "$name" "$([ "$rc" = 0 ] && echo ok || echo "FAILED rc $rc")" "$started" \
    "$(tr '\r' '\n' < "$work/$name.log" | grep -E '^(remote|remote-shm|in-process|empty-rpc) ' |
      awk '{print $1 " " $4 "/s"}' | tr '\n' ' ')"
}
! want server-step || server_step server-step f32 "$(cap 75 0)"
# The same step with the tensors through shared memory (the load tool on the server's host).
if want server-step-shm && [ "$(left)" -ge 60 ]; then
  server_step server-step-shm f32 "$(cap 75 0)" shm
fi

started=$(date +%s)
if ! want cuda-bench; then
  say "cuda-bench: not asked for (GW_CHECK_STEPS)"
elif [ -x "$build/tests/gradwire-cuda-bench" ]; then
  run "$(cap 90 0)" "$work/ours.log" "$build/tests/gradwire-cuda-bench" \
    --shapes 8192x8192x8192,16x4096x4096,256x4096x4096,2048x4096x4096 --json "$work/ours.json"
  rc=$?
  { echo "=== gradwire-cuda-bench (rc $rc)"; cat "$work/ours.log"; } >> "$out/bench.txt"
  step_done cuda-bench "$([ "$rc" = 0 ] && echo ok || echo "FAILED rc $rc")" "$started"
else
  step_done cuda-bench "not built" "$started"
fi

started=$(date +%s)
if ! want cuda-bench; then
  :
elif [ -f "$work/ours.json" ]; then
  run "$(cap 90 0)" "$work/torch-bench.log" "$tpy" scripts/device/bench_torch.py \
    --ours "$work/ours.json" --json "$work/bench.json"
  rc=$?
  { echo "=== next to PyTorch (rc $rc)"; tail -n 30 "$work/torch-bench.log"; } >> "$out/bench.txt"
  step_done torch-bench "$([ "$rc" = 0 ] && echo ok || echo "FAILED rc $rc")" "$started"
else
  step_done torch-bench "not run" "$started" "no results from gradwire-cuda-bench"
fi

# What moving one step's tensor between host and GPU costs on this machine (explains the step).
if want host-copies; then
  started=$(date +%s)
  run "$(cap 30 0)" "$work/host-copies.log" "$tpy" scripts/device/host_copies.py \
    --json "$work/host-copies.json"
  rc=$?
  { echo "=== host copies (rc $rc)"; cat "$work/host-copies.log"; } >> "$out/bench.txt"
  step_done host-copies "$([ "$rc" = 0 ] && echo ok || echo "FAILED rc $rc")" "$started"
fi

# Where the in-process step's time goes on the GPU: ModuleHost's forward and backward next to
# their GEMMs, the input's crossing onto the device and the output's back (step_breakdown).
if want step-breakdown; then
  started=$(date +%s)
  if [ -x "$build/tests/step_breakdown" ]; then
    run "$(cap 60 0)" "$work/step-breakdown.log" "$build/tests/step_breakdown" --device cuda \
      --rows 16,256,8192 --in 4096 --out 4096 --seconds 2 --json "$work/step-breakdown.json"
    rc=$?
    { echo "=== step_breakdown --device cuda (rc $rc)"; cat "$work/step-breakdown.log"; } \
      >> "$out/bench.txt"
    step_done step-breakdown "$([ "$rc" = 0 ] && echo ok || echo "FAILED rc $rc")" "$started"
  else
    step_done step-breakdown "not built" "$started"
  fi
fi
# The same with the wire copies on the compute stream (GRADWIRE_CUDA_COPY_STREAM=0, no copy lane):
# steps run back to back without a sync between them, so with the copy stream the next forward's
# input crosses while the last backward's weight-gradient GEMM still runs; this row is the
# comparison.
if want step-breakdown-one-stream; then
  started=$(date +%s)
  if [ -x "$build/tests/step_breakdown" ]; then
    GRADWIRE_CUDA_COPY_STREAM=0 run "$(cap 60 0)" "$work/step-breakdown-one-stream.log" \
      "$build/tests/step_breakdown" --device cuda --rows 16,256,8192 --in 4096 --out 4096 \
      --seconds 2 --json "$work/step-breakdown-one-stream.json"
    rc=$?
    { echo "=== GRADWIRE_CUDA_COPY_STREAM=0 step_breakdown --device cuda (rc $rc)"
      cat "$work/step-breakdown-one-stream.log"; } >> "$out/bench.txt"
    step_done step-breakdown-one-stream "$([ "$rc" = 0 ] && echo ok || echo "FAILED rc $rc")" \
      "$started"
  else
    step_done step-breakdown-one-stream "not built" "$started"
  fi
fi

# Batched inference forwards on the CUDA backend: each request's bytes as it gets them alone
# (core_test's ForwardBatchTest, with its cuda rows), then 1-row forwards from 32 clients to a
# server with batching off and on (docs/batching.md).
if want batching; then
  started=$(date +%s)
  if [ -x "$build/tests/core/core_test" ]; then
    (
      export GRADWIRE_TEST_DEVICE=cuda  # the test then fails unless its CUDA rows run
      run "$(cap 60 0)" "$work/core-batch.log" "$build/tests/core/core_test" --gtest_color=no \
        --gtest_filter='ForwardBatchTest.EveryRequestGetsTheBitsItGetsAlone'
      echo $? > "$work/core-batch.rc"
    )
    tests_excerpt "core batch (cuda rows)" "$work/core-batch.log"
    step_done core-batch "$([ "$(cat "$work/core-batch.rc")" = 0 ] && echo ok || echo FAILED)" \
      "$started"
  else
    step_done core-batch "not built" "$started"
  fi
  for mode in off on; do
    started=$(date +%s)
    flags=()
    [ "$mode" = on ] && flags=(--max-batch-rows 256)
    if start_server "batch-$mode" cuda "${flags[@]}"; then
      run "$(cap 20 0)" "$work/batch-$mode.log" "$build/client/gradwire-load" \
        --server "$server_addr" --kind linear --in 1024 --out 1024 --rows 1 --flow forward \
        -c 32 --warmup 1 --duration 5 --json "$work/batch-$mode.json"
      rc=$?
      stop_server "$server_pid"
      { echo "=== batching $mode: 1-row forwards, 32 clients (rc $rc)"
        tr '\r' '\n' < "$work/batch-$mode.log" | grep -E '^(mode|remote) ' | tail -n 2
      } >> "$out/bench.txt"
      step_done "batching-$mode" "$([ "$rc" = 0 ] && echo ok || echo "FAILED rc $rc")" "$started"
    else
      step_done "batching-$mode" FAILED "$started" "the cuda server did not start"
    fi
  done
fi

# Pinned staging of the wire crossings (--cuda-staging-mib; off by default until measured here):
# the wire ops' parity rows through 1 MiB slots (their F32 and 16-bit tensors of 1 MiB or more cross
# in several chunks; smaller ones and FP8 codes take the plain copy), then
# the step breakdown and the server step with 8 MiB slots, next to the runs above without.
if want staging; then
  started=$(date +%s)
  if [ -x "$build/tests/core/backend_parity_test" ]; then
    (
      export GRADWIRE_CUDA_STAGING_MIB=1
      run "$(cap 60 0)" "$work/staged-parity.log" "$build/tests/core/backend_parity_test" \
        --gtest_filter='*OpParity*/cuda_FromWire*:*OpParity*/cuda_ToWire' --gtest_color=no
      echo $? > "$work/staged-parity.rc"
    )
    tests_excerpt "parity with pinned staging (1 MiB)" "$work/staged-parity.log"
    c=$(grep -c -E '^\[       OK \]' "$work/staged-parity.log")
    f=$(grep -c -E '^\[  FAILED  \].*\([0-9]+ ms\)$' "$work/staged-parity.log")
    k=$(grep -c -E '^\[  SKIPPED \].*\([0-9]+ ms\)$' "$work/staged-parity.log")
    status=ok  # a skip counts as a failure, as in the parity step
    [ "$(cat "$work/staged-parity.rc")" = 0 ] && [ "$f" = 0 ] && [ "$k" = 0 ] && [ "$c" -gt 0 ] ||
      status=FAILED
    step_done staged-parity "$status" "$started" "$c passed, $f failed, $k skipped"
  else
    step_done staged-parity "not built" "$started"
  fi
  started=$(date +%s)
  if [ -x "$build/tests/step_breakdown" ]; then
    run "$(cap 60 0)" "$work/step-breakdown-staged.log" "$build/tests/step_breakdown" \
      --device cuda --cuda-staging-mib 8 --rows 16,256,8192 --in 4096 --out 4096 --seconds 2 \
      --json "$work/step-breakdown-staged.json"
    rc=$?
    { echo "=== step_breakdown --device cuda --cuda-staging-mib 8 (rc $rc)"
      cat "$work/step-breakdown-staged.log"; } >> "$out/bench.txt"
    step_done step-breakdown-staged "$([ "$rc" = 0 ] && echo ok || echo "FAILED rc $rc")" \
      "$started"
  else
    step_done step-breakdown-staged "not built" "$started"
  fi
  [ "$(left)" -lt 60 ] || server_step server-step-staged f32 "$(cap 75 0)" staged
fi

# Last, if there is time: the same f32 step with FP8 on the wire, a quarter of f32's bytes, then
# with bf16.
if want server-step-fp8 && [ "$(left)" -ge 60 ]; then
  server_step server-step-fp8 fp8 "$(cap 75 0)"
fi
# bf16 on the wire: half f32's bytes, kept bf16 on the GPU up to the Linear's cast.
if want server-step-bf16 && [ "$(left)" -ge 60 ]; then
  server_step server-step-bf16 bf16 "$(cap 75 0)"
fi

reached_end=1
cat "$out/bench.txt"
"$py" - "$json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ok = all(r["targets"][k]["met"] is True for k in
         ("parity_all_pass_none_skipped", "service_all_pass_none_skipped",
          "kernel_tests_all_pass_none_skipped", "demo_within_5pct"))
sys.exit(0 if ok else 1)
PY
