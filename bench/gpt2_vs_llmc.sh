#!/usr/bin/env bash
# GPT-2 124M training throughput on the CPU: `mt bench train --model=gpt2` against llm.c's CPU
# trainer (train_gpt2.c, OpenMP; karpathy/llm.c) and against PyTorch, at the same batch and
# sequence lengths and thread count, float32, interleaved (mt, PyTorch, llm.c, then again) so
# that a machine shared with other work slows each alike; prints every run's JSON line, then one
# summary line per sequence length with the median tokens/s of each and the ratios.
#   bench/gpt2_vs_llmc.sh [threads] [reps]
# Environment:
#   LLMC_DIR    an llm.c checkout (train_gpt2.c, llmc/); without one llm.c is skipped, saying why.
#               llm.c's own data and weights come from the Hugging Face hub; this script writes
#               stand-ins instead (bench/peers/llmc_inputs.py: a random GPT-2 124M in llm.c's
#               checkpoint format and mt's shipped corpus in its token format) and times its
#               training step with bench/peers/llmc_driver.c, compiled against the checkout with
#               llm.c's Makefile flags (-Ofast -march=native -fopenmp).
#   SEQS        sequence lengths (default "64 128 256"); LLMC_SEQS those llm.c runs at (default
#               "64": its CPU trainer takes ~10-20 s a step there on two busy cores, and 2x, 4x
#               that at 128, 256)
#   BATCH       sequences per step (default 4, llm.c's train_gpt2.c setting)
#   STEPS       steps per run, the first 2 untimed (default 6; LLMC_STEPS for llm.c, default 4)
#   MT_BUILD    mt's build directory (default build)
#   PYTHON      the Python with torch (default .venv-tf5, .venv, then python3); TORCH_COMPILE=1
#               adds a torch.compile run per repetition
#   WORK        where llm.c's inputs and driver go (default /tmp/mt-gpt2-vs-llmc)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
threads=${1:-2}
reps=${2:-3}
seqs=${SEQS:-64 128 256}
llmc_seqs=${LLMC_SEQS:-64}
batch=${BATCH:-4}
steps=${STEPS:-6}
llmc_steps=${LLMC_STEPS:-4}
mt_build=${MT_BUILD:-$root/build}
work=${WORK:-/tmp/mt-gpt2-vs-llmc}
mkdir -p "$work"
results=$work/results.jsonl
: > "$results"

py=${PYTHON:-}
if [ -z "$py" ]; then
  for c in "$root/.venv-tf5/bin/python" "$root/.venv/bin/python" python3; do
    if "$c" -c "import torch" 2>/dev/null; then py=$c; break; fi
  done
fi
torch_ok=1
if [ -z "$py" ] || ! "$py" -c "import torch" 2>/dev/null; then
  torch_ok=0
  echo '{"peer": "pytorch", "skipped": "no Python with torch (set PYTHON=...)"}' | tee -a "$results"
fi

# llm.c: build the driver against the checkout and write its inputs, or say why not.
llmc=""
if [ -z "${LLMC_DIR:-}" ]; then
  echo '{"peer": "llm.c", "skipped": "LLMC_DIR is not set (an llm.c checkout: git clone https://github.com/karpathy/llm.c)"}' | tee -a "$results"
elif [ ! -f "$LLMC_DIR/train_gpt2.c" ]; then
  echo "{\"peer\": \"llm.c\", \"skipped\": \"LLMC_DIR=$LLMC_DIR has no train_gpt2.c\"}" | tee -a "$results"
elif ! "${py:-python3}" -c "import numpy" 2>/dev/null; then
  echo '{"peer": "llm.c", "skipped": "no Python with numpy to write its inputs (set PYTHON=...)"}' | tee -a "$results"
else
  cc=${CC:-cc}
  if ! "$cc" -Ofast -march=native -fopenmp -DOMP -Wno-unused-result -I"$LLMC_DIR" \
      "$root/bench/peers/llmc_driver.c" -lm -lgomp -o "$work/llmc_driver" 2> "$work/llmc_build.log"; then
    echo "{\"peer\": \"llm.c\", \"skipped\": \"the driver did not build against $LLMC_DIR (see $work/llmc_build.log)\"}" | tee -a "$results"
  else
    "${py:-python3}" "$root/bench/peers/llmc_inputs.py" --out "$work"
    llmc=$work/llmc_driver
  fi
fi

grep -qw avx512f /proc/cpuinfo && isa=avx512 || isa=avx2
for rep in $(seq "$reps"); do
  for t in $seqs; do
    # Its own output directory: another `mt bench train` on the machine holds /tmp/mt-bench's.
    # No inherited OPENBLAS_CORETYPE: mt picks its widest kernels (train_vs_pytorch.sh).
    env -u OPENBLAS_CORETYPE "$mt_build/bin/mt" bench train --model=gpt2 \
      per_device_batch_size="$batch" max_target_length="$t" num_threads="$threads" steps="$steps" \
      base_output_directory="$work/mt-bench" 2> "$work/mt.log" | tee -a "$results" ||
      echo "{\"peer\": \"mt\", \"seq\": $t, \"failed\": \"see $work/mt.log\"}"
    if [ "$torch_ok" = 1 ]; then
      OMP_NUM_THREADS=$threads "$py" "$root/bench/peers/torch_gpt2_train.py" --threads "$threads" \
        --batch "$batch" --seq "$t" --steps "$steps" | tee -a "$results"
      if [ "${TORCH_COMPILE:-0}" = 1 ]; then
        OMP_NUM_THREADS=$threads "$py" "$root/bench/peers/torch_gpt2_train.py" --compile \
          --threads "$threads" --batch "$batch" --seq "$t" --steps "$steps" 2> /dev/null |
          tee -a "$results"
      fi
    fi
    if [ -n "$llmc" ] && [[ " $llmc_seqs " == *" $t "* ]]; then
      (cd "$work" && OMP_NUM_THREADS=$threads "$llmc" gpt2_124M.bin train.bin "$batch" "$t" \
        "$llmc_steps" 2> /dev/null | tail -1) | tee -a "$results"
    fi
  done
done

"${py:-python3}" - "$results" "$isa" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in runs:
    if "tokens_per_sec" in r:
        by.setdefault(r["seq"], {}).setdefault(r.get("peer", "mt"), []).append(r["tokens_per_sec"])
for seq in sorted(by):
    med = {k: statistics.median(v) for k, v in by[seq].items()}
    out = {"summary": "gpt2 train tokens/s, medians", "seq": seq, "cpu_isa": sys.argv[2],
           **{f"{k}_tokens_per_sec": round(v, 2) for k, v in med.items()},
           **{f"{k}_runs": len(v) for k, v in by[seq].items()}}
    for peer in med:
        if peer != "mt" and "mt" in med:
            out[f"mt_over_{peer}"] = round(med["mt"] / med[peer], 2)
    print(json.dumps(out))
PY
