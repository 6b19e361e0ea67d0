#!/usr/bin/env bash
# Trains the MoE benchmark model (mixtral-bench-100m: 102M parameters, 38M active matmul
# parameters, 8 experts top 2, dropless) with mt and with PyTorch, interleaved: each repetition
# runs `mt bench train` then bench/peers/torch_moe_train.py (same shapes, AdamW, clipping,
# load-balancing loss, float32, thread count), and the last line gives the medians over the
# repetitions of tokens/s, the ratio mt / PyTorch, FLOPs per token (active parameters only) and
# MFU against mt's CPU peak.
#   bench/moe_train_vs_pytorch.sh [threads] [steps] [repetitions] [model]
#   MT=build-x/bin/mt PYTHON=/path/to/python bench/moe_train_vs_pytorch.sh
# The peer runs at its best on this kind of machine: the fastest torch found (.venv-tf5, .venv,
# then the system's), its experts as torch.nn.functional.grouped_mm where that torch has it on
# the CPU (else a loop over experts; the JSON's moe_form says which), with the OpenMP threads
# sleeping rather than spinning at barriers (OMP_WAIT_POLICY=PASSIVE, unless set), which is
# faster on a machine whose cores are shared.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
threads=${1:-2}
steps=${2:-6}
reps=${3:-3}
model=${4:-mixtral-bench-100m}
mt=${MT:-$root/build/bin/mt}
py=${PYTHON:-}
if [ -z "$py" ]; then
  for c in "$root/.venv-tf5/bin/python" "$root/.venv/bin/python" /usr/bin/python3; do
    if [ -x "$c" ] && "$c" -c "import torch" 2>/dev/null; then py=$c; break; fi
  done
fi
[ -n "$py" ] || { echo "moe_train_vs_pytorch.sh: no python with torch found (set PYTHON=)" >&2; exit 1; }
export OMP_NUM_THREADS=$threads
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
mt_lines=() pt_lines=()
for ((r = 1; r <= reps; ++r)); do
  # Without an inherited OPENBLAS_CORETYPE: mt picks its widest kernels (train_vs_pytorch.sh).
  m=$(env -u OPENBLAS_CORETYPE "$mt" bench train --model="$model" num_threads="$threads" \
    steps="$steps")
  echo "$m"
  mt_lines+=("$m")
  # mt's CPU peak (model TFLOP/s / MFU), so the peer's MFU is against the same peak.
  peak=$(python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["model_tflops_per_sec"]/j["mfu"] if j["mfu"] else 0)' "$m")
  p=$("$py" "$root/bench/peers/torch_moe_train.py" --model "$model" --threads "$threads" \
        --steps "$steps" --peak_tflops "$peak")
  echo "$p"
  pt_lines+=("$p")
done
python3 - "$(printf '%s\n' "${mt_lines[@]}")" "$(printf '%s\n' "${pt_lines[@]}")" <<'PY'
import json, statistics, sys
ms = [json.loads(l) for l in sys.argv[1].splitlines() if l.strip()]
ps = [json.loads(l) for l in sys.argv[2].splitlines() if l.strip()]
med = lambda xs: statistics.median(xs)
mt_tps, pt_tps = med([m["tokens_per_sec"] for m in ms]), med([p["tokens_per_sec"] for p in ps])
fpt = ps[0]["flops_per_token"]
print(json.dumps({
    "bench": "moe_train_vs_pytorch", "model": ms[0]["model"], "repetitions": len(ms),
    # The median of the repetitions' ratios (each from back-to-back runs: robust to a load that
    # drifts on a shared machine), the ratio of the medians, and each repetition's.
    "ratio_tokens_per_sec_mt_over_pytorch": round(med([m["tokens_per_sec"] / p["tokens_per_sec"]
                                                       for m, p in zip(ms, ps)]), 3),
    "ratio_of_medians": round(mt_tps / pt_tps, 3),
    "ratios_per_repetition": [round(m["tokens_per_sec"] / p["tokens_per_sec"], 3) for m, p in zip(ms, ps)],
    "mt_tokens_per_sec": mt_tps, "pytorch_tokens_per_sec": pt_tps,
    "flops_per_token": fpt, "active_matmul_params": ps[0]["active_matmul_params"],
    "params": ps[0]["params"],
    "mt_mfu": round(med([m["mfu"] for m in ms]), 4),
    "pytorch_mfu": round(med([p["mfu"] for p in ps]), 4) if ps[0]["mfu"] is not None else None,
    "pytorch": ps[0]["torch"] + " (" + ps[0]["blas"] + ")", "pytorch_moe_form": ps[0]["moe_form"]}))
PY
