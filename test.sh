#!/usr/bin/env bash
# Sets up and builds mt if needed, then runs the test suite (CTest). Extra arguments pass through
# to ctest. Tests labelled `slow`, `gpu` or `fuzz` are left out unless the arguments choose labels
# themselves (-L, -LE, --label-regex, --label-exclude): `./test.sh -R Graph` runs the Graph tests
# that are not slow, gpu or fuzz; `./test.sh -L slow` runs the slow ones.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
"$root/scripts/setup.sh"
cd "${BUILD_DIR:-$root/build}"
labels=0
for a in "$@"; do
  case $a in -L* | --label-regex* | --label-exclude*) labels=1 ;; esac
done
if [ "$labels" -eq 0 ]; then set -- -LE 'slow|gpu|fuzz' "$@"; fi
exec ctest --output-on-failure -j "$(nproc)" "$@"
