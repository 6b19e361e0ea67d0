#!/usr/bin/env bash
# DeepSeek's multi-head latent attention at decode time, on the CPU: `mt bench decode` of one
# model with the compressed latent cache that decode steps attend to with the up-projections
# absorbed (mla_naive_kvcache=false, mt's default), and with every head's expanded key and value
# cached instead (mla_naive_kvcache=true, a plain multi-head cache), interleaved so that a machine
# shared with other work slows both alike. Prints every run's JSON line, then one summary line
# per dtype: the medians of prefill (one 512-token prompt), decode at batch 1 and batch 8 (after
# 128-token prompts), the cache bytes per token of each, and the ratios latent / naive.
#   bench/mla_decode.sh [model] [reps]      (default deepseek2-bench-1b, 3)
# Environment:
#   MT_BUILD   mt's build directory (default build)
#   DTYPES     float32,bfloat16 or one of them (default bfloat16)
#   STEPS      timed decode steps per run (default 16)
#   EXTRA      more key=value words for both runs (e.g. num_threads=2)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-deepseek2-bench-1b}
reps=${2:-3}
mt=${MT_BUILD:-$root/build}/bin/mt
dtypes=${DTYPES:-bfloat16}
steps=${STEPS:-16}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for ((i = 0; i < reps; ++i)); do
  for naive in false true; do
    # shellcheck disable=SC2086
    line=$("$mt" bench decode --model="$model" dtypes="$dtypes" steps="$steps" \
      mla_naive_kvcache=$naive ${EXTRA:-} 2>/dev/null | tail -n 1)
    echo "$line"
    # One row per model and dtype: naive, dtype, then the figures.
    echo "$line" | grep -o '{"model"[^}]*}' | while read -r r; do
      get() { echo "$r" | grep -o "\"$1\": [^,}]*" | sed 's/.*: //; s/"//g'; }
      echo "$naive $(get dtype) $(get prefill_512_tokens_per_sec)" \
        "$(get decode_batch1_tokens_per_sec) $(get decode_batch8_tokens_per_sec)" \
        "$(get kv_cache_bytes_per_token)" >>"$work/rows"
    done
  done
done

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
for dt in ${dtypes//,/ }; do
  declare -A m=()
  for naive in false true; do
    for col in 3 4 5 6; do
      m[$naive$col]=$(awk -v n="$naive" -v d="$dt" -v c="$col" '$1 == n && $2 == d {print $c}' \
        "$work/rows" | median)
    done
  done
  ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", (b > 0) ? a / b : 0}'; }
  printf '{"summary": "%s decode, latent (absorbed) vs naive cache, medians of %d", "dtype": "%s", ' \
    "$model" "$reps" "$dt"
  printf '"prefill_512_tokens_per_sec": [%s, %s], "decode_batch1_tokens_per_sec": [%s, %s], ' \
    "${m[false3]}" "${m[true3]}" "${m[false4]}" "${m[true4]}"
  printf '"decode_batch8_tokens_per_sec": [%s, %s], "kv_cache_bytes_per_token": [%s, %s], ' \
    "${m[false5]}" "${m[true5]}" "${m[false6]}" "${m[true6]}"
  printf '"ratio_decode_batch1": %s, "ratio_decode_batch8": %s, "cache_bytes_naive_over_latent": %s}\n' \
    "$(ratio "${m[false4]}" "${m[true4]}")" "$(ratio "${m[false5]}" "${m[true5]}")" \
    "$(ratio "${m[true6]}" "${m[false6]}")"
  unset m
done
