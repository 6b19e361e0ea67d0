#!/usr/bin/env bash
# Installs what mt needs from Debian (only what is missing, quietly), configures and builds.
# Used by ./run.sh and ./test.sh; safe to run any number of times.
#   BUILD_DIR   build directory (default: build)
#   BUILD_TYPE  CMake build type (default: Release)
#   MT_JOBS     parallel build jobs (default: all cores)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
packages=(cmake g++ make pkg-config ccache libboost-dev libyaml-cpp-dev libtbb-dev
  libopenblas-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev libpcre2-dev
  libsentencepiece-dev libutf8proc-dev libopenmpi-dev openmpi-bin libsimde-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq >/dev/null
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
jobs=${MT_JOBS:-$(nproc)}
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" ${MT_CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$build" -j "$jobs" 2>&1 | grep -Ev '^\[ *[0-9]+%\]|^(Consolidate|Scanning|Built target)' || true
test "${PIPESTATUS[0]}" -eq 0
