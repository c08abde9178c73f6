#!/usr/bin/env bash
# Stage 1 on a GPU machine: the torch-free CUDA kernels alone. Needs CMake, nvcc, a C++ compiler
# and GoogleTest (Debian's, carried in .device-deps/: scripts/device/deps.sh --gtest here), and
# python3 with CUDA torch for the PyTorch side of the benchmark. Nothing from gRPC or libtorch's
# C++ is built, so this stage runs even when the full build (stage2.sh) would fail.
#
#   device run, repo root, carry [".device-deps"]:   scripts/device/stage1.sh [--quick]
#
# Writes under $OUT (or build-stage1/out): gpu.txt, build.txt, tests.txt (+ one XML per test
# binary), ours.json/ours.txt (the C++ benchmark), bench.json/bench.txt (next to PyTorch).
# Exit status: the tests' (the benchmark still runs after a test failure, and says so).
set -uo pipefail
cd "$(dirname "$0")/../.."
quick=""
[ "${1:-}" = "--quick" ] && quick="--quick"
out=${OUT:-build-stage1/out}
mkdir -p "$out"
# shellcheck disable=SC1091
source scripts/device/env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,power.limit,memory.total \
  --format=csv | tee "$out/gpu.txt"

start=$(date +%s)
{
  cmake -S . -B build-stage1 -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADWIRE_KERNELS_ONLY=ON \
    -DGRADWIRE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" &&
    cmake --build build-stage1 -j "$(nproc)"
} > "$out/build.txt" 2>&1
build_rc=$?
echo "stage1: build rc=$build_rc in $(( $(date +%s) - start )) s"
if [ "$build_rc" != 0 ]; then
  tail -n 60 "$out/build.txt"
  exit 1
fi

# Tests first: a benchmark of wrong kernels is worthless. On this machine nothing may skip.
tests_rc=0
: > "$out/tests.txt"
for t in kernels_test cuda_host_test cuda_kernels_test; do
  build-stage1/tests/$t --gtest_output="xml:$out/$t.xml" >> "$out/tests.txt" 2>&1 || tests_rc=1
done
grep -E '^\[ measured \]|^\[  FAILED  \]|^\[  PASSED  \]|^\[  SKIPPED \]|tests? ran' \
  "$out/tests.txt" | sort | uniq -c | sort -rn | head -40
grep -q 'SKIPPED \]' "$out/tests.txt" && { echo "stage1: tests were SKIPPED on a GPU machine"; tests_rc=1; }
grep -E '^\[ measured \]' "$out/tests.txt"
echo "stage1: tests rc=$tests_rc"

build-stage1/tests/gradwire-cuda-bench $quick --json "$out/ours.json" > "$out/ours.txt" 2>&1 \
  || { echo "stage1: some benchmark cases failed"; tests_rc=1; }
[ -f "$out/ours.json" ] || { cat "$out/ours.txt"; exit 1; }
python3 scripts/device/bench_torch.py --ours "$out/ours.json" --json "$out/bench.json" \
  > "$out/bench.txt" 2>&1 || echo "stage1: PyTorch side failed"
cat "$out/ours.txt" "$out/bench.txt"
echo "stage1: tests rc=$tests_rc, results in $out"
exit "$tests_rc"
