#!/usr/bin/env bash
# Data-parallel efficiency on one machine: `mt bench train` of one model as 1 rank and as N
# ranks under mpirun (ici_data_parallelism=N), each rank with the same per_device_batch_size
# and THREADS_PER_RANK threads, interleaved REPS times so that other load on the machine slows
# each alike. Prints every run's JSON line, then one summary line: the median tokens/s (every
# rank's tokens) of each and the efficiency N-rank tokens/s / (N x 1-rank tokens/s), which is
# 1.0 when the ranks add nothing but their gradient all-reduce to a step, and the median share
# of an N-rank step spent waiting for collectives (exposed: each layer's gradient sum overlaps
# the backward of the layers below; the "serial" run, MT_OVERLAP_COMMUNICATION=0, sums them all
# after the backward, for comparison). Also runs 1 rank
# with N x THREADS_PER_RANK threads (the same cores as the N ranks, used by one process) for
# comparison, the N ranks again with shard_optimizer_over_data=true (ZeRO-1: the same
# traffic, 1/N of the moments per rank) and with ici_fsdp_parallelism=N (FSDP: 1/N of the
# weights, gradients and moments, each layer's weights gathered and its gradients
# reduce-scattered inside the step) to show what sharding costs, and N tensor-parallel ranks
# (ici_tensor_parallelism=N: one batch split by heads and MLP columns, so its tokens/s is
# compared with one rank's).
#   bench/dp_scaling.sh [model] [ranks] [reps]     (default llama-small, 2, 3)
# Environment:
#   MT_BUILD           mt's build directory (default build)
#   THREADS_PER_RANK   (default 1)
#   STEPS              steps per run, the first 2 untimed (default 8)
#   EXTRA              more key=value words for every run (e.g. per_device_batch_size=4)
# Needs OpenMPI's mpirun (Debian: openmpi-bin); --oversubscribe lets N exceed the cores.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:-llama-small}
ranks=${2:-2}
reps=${3:-3}
mt=${MT_BUILD:-$root/build}/bin/mt
tpr=${THREADS_PER_RANK:-1}
steps=${STEPS:-8}
if ! command -v mpirun > /dev/null; then
  echo '{"bench": "dp_scaling", "skipped": "mpirun was not found (Debian: apt-get install openmpi-bin libopenmpi-dev)"}'
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run() {  # label ranks threads [more words] [data axis] [overlap 1/0]
  local line
  # shellcheck disable=SC2086
  line=$(mpirun --oversubscribe --allow-run-as-root -np "$2" env MT_OVERLAP_COMMUNICATION="${6:-1}" \
    "$mt" bench train --model="$model" \
    num_threads="$3" steps="$steps" ici_data_parallelism="${5:-$2}" \
    base_output_directory="$work/out-$1" ${EXTRA:-} ${4:-} 2>/dev/null | tail -n 1)
  echo "$line"
  echo "$1 $(echo "$line" | grep -o '"tokens_per_sec": [0-9.]*' | sed 's/.*: //') $(echo "$line" | grep -o '"communication_share": [0-9.]*' | sed 's/.*: //')" >> "$work/rows"
}
for ((i = 0; i < reps; ++i)); do
  run one 1 "$tpr"
  run many "$ranks" "$tpr"
  run serial "$ranks" "$tpr" "" "$ranks" 0
  run wide 1 $((ranks * tpr))
  run sharded "$ranks" "$tpr" shard_optimizer_over_data=true
  run fsdp "$ranks" "$tpr" ici_fsdp_parallelism="$ranks" 1
  run tensor "$ranks" "$tpr" ici_tensor_parallelism="$ranks" 1
done

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
one=$(awk '$1 == "one" {print $2}' "$work/rows" | median)
many=$(awk '$1 == "many" {print $2}' "$work/rows" | median)
wide=$(awk '$1 == "wide" {print $2}' "$work/rows" | median)
sharded=$(awk '$1 == "sharded" {print $2}' "$work/rows" | median)
many_comm=$(awk '$1 == "many" {print $3}' "$work/rows" | median)
sharded_comm=$(awk '$1 == "sharded" {print $3}' "$work/rows" | median)
fsdp=$(awk '$1 == "fsdp" {print $2}' "$work/rows" | median)
fsdp_comm=$(awk '$1 == "fsdp" {print $3}' "$work/rows" | median)
tensor=$(awk '$1 == "tensor" {print $2}' "$work/rows" | median)
serial=$(awk '$1 == "serial" {print $2}' "$work/rows" | median)
serial_comm=$(awk '$1 == "serial" {print $3}' "$work/rows" | median)
awk -v m="$model" -v n="$ranks" -v t="$tpr" -v r="$reps" -v one="$one" -v many="$many" -v wide="$wide" -v sh="$sharded" -v mc="$many_comm" -v sc="$sharded_comm" -v fs="$fsdp" -v fc="$fsdp_comm" -v tp="$tensor" -v se="$serial" -v sec="$serial_comm" 'BEGIN {
  printf "{\"summary\": \"%s data parallelism, medians of %d\", \"threads_per_rank\": %d, ", m, r, t
  printf "\"one_rank_tokens_per_sec\": %s, \"ranks\": %d, \"ranks_tokens_per_sec\": %s, ", one, n, many
  printf "\"efficiency\": %.3f, \"one_rank_with_all_threads_tokens_per_sec\": %s, ", (one > 0) ? many / (n * one) : 0, wide
  printf "\"ranks_over_one_rank_with_all_threads\": %.3f, ", (wide > 0) ? many / wide : 0
  printf "\"ranks_communication_share\": %s, \"sharded_communication_share\": %s, ", mc, sc
  printf "\"serial_sums_tokens_per_sec\": %s, \"serial_sums_communication_share\": %s, ", se, sec
  printf "\"overlap_over_serial_sums\": %.3f, ", (se > 0) ? many / se : 0
  printf "\"sharded_optimizer_tokens_per_sec\": %s, \"sharded_over_plain\": %.3f, ", sh, (many > 0) ? sh / many : 0
  printf "\"fsdp_tokens_per_sec\": %s, \"fsdp_over_plain\": %.3f, \"fsdp_communication_share\": %s, ", fs, (many > 0) ? fs / many : 0, fc
  printf "\"tensor_parallel_tokens_per_sec\": %s, \"tensor_parallel_over_one_rank\": %.3f}\n", tp, (one > 0) ? tp / one : 0
}'
