#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (sm_90): configure and build the CUDA backend, run its tests,
# then the benchmark — our FP8 GEMM and module steps next to torch._scaled_mm, bf16 torch.matmul
# and bf16 PyTorch autograd — printing one table and writing one JSON.
#
#   Prepare here (dev machine, repo root):   ../shared/scripts/device-deps.sh   (fills .device-deps/)
#   Run there (repo root, .device-deps/ carried along):   scripts/device-bench.sh [--all-tests]
#
# Results go to $OUT (when set, e.g. by the device runner) or build-device/bench/:
#   tests.txt (ctest output), ours.json (C++ bench), bench.json + bench.txt (merged, with ratios).
# --all-tests runs the whole ctest suite instead of the kernel and CUDA tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
all_tests=0
[ "${1:-}" = "--all-tests" ] && all_tests=1
if [ ! -f .device-deps/device-env.sh ]; then
  echo "device-bench: .device-deps/ is missing: run ../shared/scripts/device-deps.sh first" >&2
  exit 2
fi
# shellcheck disable=SC1091
source .device-deps/device-env.sh
out=${OUT:-build-device/bench}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$out/gpu.txt"

jobs=$(nproc)
cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADWIRE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > "$out/configure.txt" 2>&1 \
  || { tail -n 40 "$out/configure.txt"; echo "device-bench: configure failed" >&2; exit 1; }
if [ "$all_tests" = 1 ]; then
  cmake --build build-device -j "$jobs"
else
  cmake --build build-device -j "$jobs" --target kernels_test cuda_host_test cuda_kernels_test \
    cuda_core_test gradwire-cuda-bench
fi

# Tests first: a benchmark of wrong kernels is worthless. GPU tests must run here, not skip.
set +e
if [ "$all_tests" = 1 ]; then
  (cd build-device && ctest -j 8 --timeout 900 --output-on-failure) > "$out/tests.txt" 2>&1
else
  for t in kernels_test cuda_host_test cuda_kernels_test cuda_core_test; do
    build-device/tests/$t --gtest_brief=1
  done > "$out/tests.txt" 2>&1
fi
tests_rc=$?
set -e
tail -n 30 "$out/tests.txt"
if grep -q "SKIPPED" "$out/tests.txt"; then
  echo "device-bench: some tests were skipped on a GPU machine (see $out/tests.txt)" >&2
fi

build-device/tests/gradwire-cuda-bench --json "$out/ours.json" | tee "$out/ours.txt"
python3 scripts/device_bench_torch.py --ours "$out/ours.json" --json "$out/bench.json" \
  | tee "$out/bench.txt"
echo "device-bench: tests rc=$tests_rc; results in $out"
exit "$tests_rc"
