#!/usr/bin/env bash
# Builds the libFuzzer targets with clang into build-fuzz/ and runs each for a bounded time.
#   scripts/fuzz.sh [seconds per target, default 60] [target...]
# Each target starts from its committed seeds (tests/fuzz/corpus/<target>/) and writes what it
# finds to build-fuzz/corpus/<target>/ (not committed); crashes land in build-fuzz/artifacts/.
# A crash, a sanitizer report or a broken invariant makes the script fail. BUILD_DIR=... JOBS=...
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/ccache.sh
source scripts/lib/ccache.sh
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(request_fuzzer safetensors_fuzzer checkpoint_fuzzer zero_copy_fuzzer)
build_dir=${BUILD_DIR:-build-fuzz}
jobs=${JOBS:-2}
if [ ! -f "$build_dir/build.ninja" ]; then
  CC=${CC:-clang} CXX=${CXX:-clang++} cmake -S . -B "$build_dir" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADWIRE_FUZZ=ON -DGRADWIRE_CUDA=OFF \
    -DGRADWIRE_E2E_TESTS=OFF
fi
start=$(date +%s)
cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"
echo "fuzz: build done in $(( $(date +%s) - start )) s ($build_dir)"
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
failed=()
for t in "${targets[@]}"; do
  corpus="$build_dir/corpus/$t"
  artifacts="$build_dir/artifacts/$t/"
  mkdir -p "$corpus" "$artifacts"
  dict=()
  [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
  echo "fuzz: $t for ${seconds} s"
  # -rss_limit_mb: a request may legitimately allocate what its bytes describe, no more.
  if ! "$build_dir/tests/fuzz/$t" "$corpus" "tests/fuzz/corpus/$t" "${dict[@]}" \
      -max_total_time="$seconds" -rss_limit_mb=3072 -timeout=30 -max_len=8192 \
      -print_final_stats=1 -artifact_prefix="$artifacts" 2>"$build_dir/$t.log"; then
    failed+=("$t")
    tail -60 "$build_dir/$t.log" >&2
  fi
  grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|^#[0-9]+ +DONE" \
    "$build_dir/$t.log" | sed "s/^/fuzz: $t: /" || true
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (inputs in $build_dir/artifacts/)" >&2
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets clean"
