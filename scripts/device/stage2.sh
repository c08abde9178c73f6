#!/usr/bin/env bash
# Stage 2 on a GPU machine: the whole project against the machine's libtorch (python3's torch,
# with CUDA) and Debian's gRPC/protobuf/spdlog/GoogleTest unpacked from .device-deps/
# (scripts/device/deps.sh here). Builds, runs the CUDA and CPU suites, then a demo training.
#
# scripts/device/gpu-check.sh supersedes this for a short device call: it builds only what it
# runs, skips the CPU suites (CI runs them), puts a timeout on every step and writes
# cuda-stage2.json as it goes. This script builds and tests everything and may not fit one call.
#
#   device run, repo root, carry [".device-deps"]:   scripts/device/stage2.sh
#
# Writes under $OUT (or build-device/out): gpu.txt, abi.txt, configure.txt, build.txt,
# ctest.txt, demo-*.txt. Exit status: non-zero when the build or a test failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-build-device/out}
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/device/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"

# Debian's gRPC and protobuf use the C++11 ABI of std::string: libtorch must too, or nothing links.
python3 - > "$out/abi.txt" 2>&1 <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("cxx11_abi", torch._C._GLIBCXX_USE_CXX11_ABI)
PY
cat "$out/abi.txt"
grep -q "cxx11_abi True" "$out/abi.txt" || { echo "stage2: libtorch is not built with the C++11 ABI"; exit 1; }

start=$(date +%s)
rm -f build-device/CMakeCache.txt  # a fresh configure; objects already built are kept
cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADWIRE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DGRADWIRE_E2E_TESTS=OFF ${GW_CMAKE_ARGS:-} \
  -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > "$out/configure.txt" 2>&1 \
  || { tail -n 40 "$out/configure.txt"; echo "stage2: configure failed"; exit 1; }
cmake --build build-device -j "$(nproc)" -- -k 0 > "$out/build.txt" 2>&1
build_rc=$?
echo "stage2: build rc=$build_rc in $(( $(date +%s) - start )) s"
if [ "$build_rc" != 0 ]; then
  grep -E "error|Error" "$out/build.txt" | head -n 40
fi

start=$(date +%s)
(cd build-device && ctest -j 12 --timeout 300 --output-on-failure) > "$out/ctest.txt" 2>&1
tests_rc=$?
echo "stage2: ctest rc=$tests_rc in $(( $(date +%s) - start )) s"
grep -E "tests passed|tests failed|\(Failed\)|\(SEGFAULT\)|\(Timeout\)|Not Run" "$out/ctest.txt" | head -n 40
grep -c "Skipped" "$out/ctest.txt" | sed 's/^/stage2: skipped tests: /'

# The CUDA backend against the reference, op by op and module by module: nothing may skip here.
if [ -x build-device/tests/core/backend_parity_test ]; then
  build-device/tests/core/backend_parity_test > "$out/parity.txt" 2>&1
  parity_rc=$?
  echo "stage2: parity rc=$parity_rc: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/parity.txt" | sort | uniq -c | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$out/parity.txt" | head -n 20
  grep -B2 -A8 'Failure' "$out/parity.txt" | head -n 40
  [ "$parity_rc" = 0 ] || tests_rc=1
  grep -q '^\[  SKIPPED \]' "$out/parity.txt" && { echo "stage2: parity rows SKIPPED on a GPU"; tests_rc=1; }
fi

# The service suites again, the test server on the CUDA backend (GRADWIRE_TEST_DEVICE).
: > "$out/service-cuda.txt"
for t in build-device/tests/service/*_test; do
  [ -x "$t" ] || continue
  GRADWIRE_TEST_DEVICE=cuda timeout 300 "$t" --gtest_brief=1 > "$out/svc-$(basename "$t").txt" 2>&1 &
done
wait
for f in "$out"/svc-*.txt; do
  r=$(grep -E '^\[  (PASSED|FAILED) |tests? ran' "$f" | tr '\n' ' ')
  echo "$(basename "$f" .txt): $r" | tee -a "$out/service-cuda.txt"
  grep -q '^\[  FAILED  \]' "$f" && { tests_rc=1; grep -A6 'Failure' "$f" | head -n 20; }
  grep -q '^\[  PASSED  \]' "$f" || tests_rc=1
done
cat "$out"/svc-*.txt > "$out/service-cuda-log.txt"; rm -f "$out"/svc-*.txt

# The demo training through a real server, on the CPU and on the GPU: the same final loss.
# start_server LOG FLAGS...: runs in this shell, not in $(...), so server_pid stays set here
# (a subshell would lose it); sets addr from the server's --port-file.
server_pid=""
stop_server() {
  [ -n "$server_pid" ] || return 0
  kill "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  server_pid=""
}
trap stop_server EXIT
start_server() {
  rm -f "$out/port"
  build-device/server/gradwire-server --listen 127.0.0.1:0 --port-file "$out/port" "${@:2}" \
    > "$1" 2>&1 &
  server_pid=$!
  addr=""
  for _ in $(seq 150); do
    [ -s "$out/port" ] && { addr=$(cat "$out/port"); return 0; }
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.2
  done
  echo "stage2: the server did not start: $(tail -n 3 "$1")"
  return 1
}
if [ -x build-device/server/gradwire-server ]; then
  for model in linear mlp; do
    for device in cpu cuda; do
      if ! start_server "$out/demo-$model-$device-server.txt" --device "$device"; then
        tests_rc=1
        continue
      fi
      timeout 120 build-device/client/gradwire demo --server "$addr" --model "$model" --json \
        > "$out/demo-$model-$device.txt" 2>&1
      echo "stage2: demo $model on $device rc=$?: $(tail -n 2 "$out/demo-$model-$device.txt" | head -n 1)"
      stop_server
    done
    python3 - "$out/demo-$model-cpu.txt" "$out/demo-$model-cuda.txt" <<'PY' || tests_rc=1
import json, sys
cpu, gpu = (json.loads(open(p).read().strip().splitlines()[-1])["final_loss"] for p in sys.argv[1:])
ok = abs(gpu - cpu) <= 0.05 * cpu
print(f"stage2: final loss cpu {cpu:.5f} cuda {gpu:.5f}: {'within' if ok else 'NOT within'} 5%")
sys.exit(0 if ok else 1)
PY
  done

  # (c) The server step over loopback next to the in-process step, both on the GPU. 8192 rows
  # of 4096 f32 are 128 MiB a message each way: over the 64 MiB default limits on both ends.
  if start_server "$out/bench-server.txt" --device cuda --max-message-mib 512 \
    --max-request-bytes 512MiB; then
    timeout 120 build-device/client/gradwire-load --server "$addr" --max-message-mib 512 \
      --kind linear --in 4096 --out 4096 --rows 8192 --flow step --concurrency 1 --warmup 3 \
      --duration 20 --baselines --baseline-device cuda --json "$out/server-step.json" \
      > "$out/server-step.txt" 2>&1
    echo "stage2: server step benchmark rc=$?"
    tail -n 25 "$out/server-step.txt"
    stop_server
  fi
fi
[ "$build_rc" = 0 ] && [ "$tests_rc" = 0 ]
