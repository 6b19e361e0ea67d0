#!/usr/bin/env bash
# Fuzzes the file readers with libFuzzer (tests/fuzz/README.md): configures a clang build of mt
# in build-fuzz/ (BUILD_DIR overrides), builds only the fuzz harnesses and runs the tests
# labelled fuzz, each harness for MT_FUZZ_SECONDS seconds (default 60), one per core
# (MT_JOBS). Extra arguments go to ctest (-R fuzz.json: that one only). Exits 0 with a message
# saying it skipped where clang or libFuzzer is missing.
#   MT_FUZZ_SECONDS=600 tests/fuzz/run.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${BUILD_DIR:-$root/build-fuzz}
skip() {
  echo "tests/fuzz/run.sh: skipped: $*" >&2
  exit 0
}
if ! command -v clang >/dev/null || ! command -v clang++ >/dev/null; then
  skip "clang is not installed (Debian: apt-get install clang)"
fi
if [ -f "$build/CMakeCache.txt" ]; then
  cmake "$build" >/dev/null  # again: a build from before the fuzz harnesses has not asked
else
  # Only what the harnesses need: no benchmarks, no CUDA plugin; symbols for the stack traces.
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DMT_BUILD_BENCH=OFF -DMT_CUDA=OFF >/dev/null
fi
# tests/fuzz/CMakeLists.txt records whether -fsanitize=fuzzer links; a g++ build never asks.
if ! grep -q '^MT_LIBFUZZER_LINKS:INTERNAL=' "$build/CMakeCache.txt"; then
  skip "$build is not a clang build (remove it to let this script configure one)"
fi
if ! grep -q '^MT_LIBFUZZER_LINKS:INTERNAL=1$' "$build/CMakeCache.txt"; then
  skip "clang++ cannot link -fsanitize=fuzzer: libFuzzer (compiler-rt) is missing"
fi
jobs=${MT_JOBS:-$(nproc)}
cmake --build "$build" -j "$jobs" --target mt_fuzz
cd "$build"
exec ctest --output-on-failure -j "$jobs" -L fuzz "$@"
