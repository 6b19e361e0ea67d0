#!/usr/bin/env bash
# Sets up and builds mt if needed, then runs `mt run` with the given arguments.
# With no arguments: trains the embedded default (a small Llama on the shipped corpus, CPU).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
"$root/scripts/setup.sh"
exec "${BUILD_DIR:-$root/build}/bin/mt" run "$@"
