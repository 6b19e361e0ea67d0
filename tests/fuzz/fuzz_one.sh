#!/usr/bin/env bash
# The ctest fuzz.<reader>: fuzz_one.sh FUZZER SEEDS WORK [libFuzzer options...]
# Fuzzes for MT_FUZZ_SECONDS (default 60) from the seeds (read only) and WORK/corpus, where the
# inputs libFuzzer finds interesting accumulate from run to run. A crash, a sanitizer report, a
# finding of the harness, a hang past 10 s or memory past 2 GiB saves the input under
# WORK/artifacts/ and fails the test. MT_FUZZ_ARGS adds libFuzzer options (e.g. -jobs=2).
set -euo pipefail
fuzzer=$1 seeds=$2 work=$3
shift 3
mkdir -p "$work/corpus" "$work/artifacts"
status=0
# shellcheck disable=SC2086  # MT_FUZZ_ARGS is a list of options
"$fuzzer" -max_total_time="${MT_FUZZ_SECONDS:-60}" -rss_limit_mb=2048 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$@" ${MT_FUZZ_ARGS:-} \
  "$work/corpus" "$seeds" || status=$?
if [ "$status" -ne 0 ]; then
  echo "fuzz: $(basename "$fuzzer") failed (exit $status); the input is in $work/artifacts/." >&2
  echo "fuzz: replay it with '$fuzzer <file>'; once fixed, copy it into $seeds/ as a regression" \
    "input." >&2
fi
exit "$status"
