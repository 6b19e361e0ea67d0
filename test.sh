#!/usr/bin/env bash
# Sets up and builds mt if needed, then runs the test suite (CTest). Tests labelled `slow` and
# `gpu` are left out; run them with `./test.sh -L slow` or `-L gpu` (extra ctest arguments pass
# through).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
"$root/scripts/setup.sh"
cd "${BUILD_DIR:-$root/build}"
if [ $# -eq 0 ]; then set -- -LE 'slow|gpu|fuzz'; fi
exec ctest --output-on-failure -j "$(nproc)" "$@"
