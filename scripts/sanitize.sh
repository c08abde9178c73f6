#!/usr/bin/env bash
# Builds the unit and service suites with a sanitizer and runs them with ctest.
#   scripts/sanitize.sh asan   ASan + UBSan (UBSan aborts on the first report), in build-asan/
#   scripts/sanitize.sh tsan   TSan, in build-tsan/
# BUILD_DIR=... JOBS=... CTEST_ARGS="-R pattern" to override. SANITIZE_TARGETS="a_test b_test"
# builds and runs only those test programs (CI does that in the fuzz build, which is already
# compiled with clang, ASan and UBSan: one instrumented build serves both). The end-to-end, Python and deploy
# tests are left out (GRADWIRE_E2E_TESTS=OFF): they drive separate processes and scripts.
# Debian's libtorch and gRPC are not instrumented; tests/sanitizers/*.supp hold the suppressions
# for their frames (see docs/reliability.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/ccache.sh
source scripts/lib/ccache.sh
kind=${1:-}
root=$PWD
gtest_filter=
ctest_exclude=
case "$kind" in
  asan)
    sanitize=address
    build_dir=${BUILD_DIR:-build-asan}
    # detect_leaks stays on: LSan reports only what our code and gRPC leave behind at exit.
    export ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1:abort_on_error=0:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
    export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$root/tests/sanitizers/ubsan.supp${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
    ;;
  tsan)
    sanitize=thread
    build_dir=${BUILD_DIR:-build-tsan}
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/sanitizers/tsan.supp${TSAN_OPTIONS:+:$TSAN_OPTIONS}"
    # libtorch's intra-op pool is uninstrumented: its workers' writes look unsynchronised to
    # TSan. One intra-op thread keeps ATen's work on the calling (instrumented) thread.
    export OMP_NUM_THREADS=1
    # The in-process transport hands the client's tensor slices to the server's threads (and the
    # server's back) with no copy, through gRPC's uninstrumented locks: TSan sees the client
    # thread's write and the executor's read with no order between them and reports a race that
    # is not one (the slices are owned by gRPC's refcount; ASan runs these tests). Over TCP the
    # bytes cross the kernel, so the same tests run here on the TCP transport only.
    gtest_filter='-*/InProcess'
    ctest_exclude='/InProcess( |$)'  # ctest names end in "  # GetParam() = ..."
    ;;
  *)
    echo "usage: $0 asan|tsan" >&2
    exit 2
    ;;
esac
jobs=${JOBS:-2}
if [ ! -f "$build_dir/build.ninja" ]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DGRADWIRE_SANITIZE="$sanitize" -DGRADWIRE_E2E_TESTS=OFF -DGRADWIRE_CUDA=OFF
fi
start=$(date +%s)
if [ -n "${SANITIZE_TARGETS:-}" ]; then
  # Only these test programs: built, then run directly (gtest), each to the end.
  # shellcheck disable=SC2086
  cmake --build "$build_dir" -j "$jobs" --target $SANITIZE_TARGETS
  echo "sanitize $kind: build done in $(( $(date +%s) - start )) s ($build_dir)"
  failed=()
  for t in $SANITIZE_TARGETS; do
    exe=$(find "$build_dir/tests" -type f -name "$t" -perm -u+x | head -1)
    [ -n "$exe" ] || { echo "sanitize $kind: $t was not built" >&2; exit 1; }
    t0=$(date +%s)
    if "$exe" --gtest_brief=1 ${gtest_filter:+--gtest_filter="$gtest_filter"} > "$build_dir/$t.sanitize.log" 2>&1; then
      echo "sanitize $kind: $t clean ($(grep -Eo '[0-9]+ tests? from [0-9]+ test suites? ran' "$build_dir/$t.sanitize.log" | tail -1), $(( $(date +%s) - t0 )) s)"
    else
      failed+=("$t")
      tail -80 "$build_dir/$t.sanitize.log" >&2
    fi
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "sanitize $kind: FAILED: ${failed[*]} (logs in $build_dir/*.sanitize.log)" >&2
    exit 1
  fi
  exit 0
fi
cmake --build "$build_dir" -j "$jobs"
echo "sanitize $kind: build done in $(( $(date +%s) - start )) s ($build_dir)"
start=$(date +%s)
cd "$build_dir"
# shellcheck disable=SC2086
ctest --output-on-failure -j "$jobs" --timeout 900 ${ctest_exclude:+-E "$ctest_exclude"} ${CTEST_ARGS:-}
echo "sanitize $kind: tests done in $(( $(date +%s) - start )) s"
