#!/usr/bin/env bash
# Trains configuration M with mt and with PyTorch back to back (same shapes, optimizer, float32,
# thread count) and prints both JSON lines and the ratio mt / PyTorch in tokens/s.
#   bench/train_vs_pytorch.sh [threads] [steps]
# The peer is the fastest PyTorch a user would install: PYTHON when set, else the first of
# .venv-tf5, .venv (PyTorch 2 from pip, with MKL: tools/setup_reference_env_tf5.sh) and
# python3 (Debian's python3-torch 1.13, about 1.3x slower on this model) that imports torch.
# Debian's build uses OpenBLAS, forced here to the widest kernels the CPU runs (SkylakeX with
# AVX-512, else Haswell with AVX2) and, when installed, its OpenMP variant. mt runs without an
# inherited OPENBLAS_CORETYPE (it picks the same widest kernels itself): an environment that
# holds OpenBLAS narrower than the CPU would measure that setting, not either peer.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
threads=${1:-2}
steps=${2:-6}
mt_json=$(env -u OPENBLAS_CORETYPE "$root/build/bin/mt" bench train num_threads="$threads" \
  steps="$steps")
echo "$mt_json"
py=${PYTHON:-}
if [ -z "$py" ]; then
  for c in "$root/.venv-tf5/bin/python" "$root/.venv/bin/python" python3; do
    if "$c" -c "import torch" 2>/dev/null; then py=$c; break; fi
  done
fi
[ -n "$py" ] || { echo '{"peer": "pytorch", "skipped": "no Python with torch (set PYTHON=...)"}'; exit 0; }
omp=/usr/lib/x86_64-linux-gnu/openblas-openmp
if grep -qw avx512f /proc/cpuinfo; then coretype=SkylakeX; else coretype=Haswell; fi
export OPENBLAS_CORETYPE=$coretype
[ -d "$omp" ] && export LD_LIBRARY_PATH=$omp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OMP_NUM_THREADS=$threads
pt_json=$("$py" "$root/bench/peers/torch_train.py" --threads "$threads" --steps "$steps")
echo "$pt_json"
python3 - "$mt_json" "$pt_json" <<'PY'
import json, sys
m, p = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps({"ratio_tokens_per_sec_mt_over_pytorch": round(m["tokens_per_sec"] / p["tokens_per_sec"], 3),
                  "mt_tokens_per_sec": m["tokens_per_sec"], "pytorch_tokens_per_sec": p["tokens_per_sec"],
                  "mt_mfu": m["mfu"]}))
PY
