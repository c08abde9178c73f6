#!/usr/bin/env bash
# Stage 2 on a GPU machine: the whole project against the machine's libtorch (python3's torch,
# with CUDA) and Debian's gRPC/protobuf/spdlog/GoogleTest unpacked from .device-deps/
# (scripts/device/deps.sh here). Builds, runs the CUDA and CPU suites, then a demo training.
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

# The demo training through a real server, on the device the server accepts.
if [ -x build-device/server/gradwire-server ]; then
  for model in linear mlp; do
    port_log="$out/demo-$model-server.txt"
    build-device/server/gradwire-server --listen 127.0.0.1:0 ${GW_SERVER_ARGS:-} > "$port_log" 2>&1 &
    pid=$!
    for _ in $(seq 50); do grep -q "listening on" "$port_log" && break; sleep 0.2; done
    addr=$(grep -o "listening on [0-9.:]*" "$port_log" | awk '{print $3}')
    build-device/client/gradwire demo --server "$addr" --model "$model" --json \
      > "$out/demo-$model.txt" 2>&1
    echo "stage2: demo $model rc=$?: $(tail -n 2 "$out/demo-$model.txt" | head -n 1)"
    kill "$pid"; wait "$pid" 2>/dev/null
  done
fi
[ "$build_rc" = 0 ] && [ "$tests_rc" = 0 ]
