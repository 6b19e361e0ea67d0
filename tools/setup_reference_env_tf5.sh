#!/usr/bin/env bash
# Python environment with transformers 5 for tools/make_hf_golden.py; mt itself and its tests
# never need it: the data it makes is committed under tests/golden/hf_tf5/.
#
# transformers 5 needs a recent torch (>= 2.4), which Debian does not package, so torch comes
# from PyPI's Linux wheel, which pulls in the CUDA runtime packages (5.6 GB on disk, about five
# minutes; only the CPU is used). The venv is a plain one on
# /usr/bin/python3 (no --system-site-packages: Debian's torch 1.13 must not shadow it). The
# transformers 4.44 environment of tools/setup_reference_env.sh (.venv) is separate and stays as
# it is, since the older goldens document it.
#   VENV  where to create it (default: <repo>/.venv-tf5, which git ignores)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$root/.venv-tf5}
# The versions the committed goldens were made with (tests/golden/hf_tf5/reference.json).
torch_version=2.15.0
transformers_version=5.24.0
safetensors_version=0.8.0
numpy_version=2.4.6

if ! dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | grep -q "install ok installed"; then
  sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq >/dev/null
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
fi
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv "$venv"
fi
pip=("$venv/bin/pip" install -q)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "${pip[@]}" "torch==$torch_version"
fi
"${pip[@]}" "transformers==$transformers_version" "safetensors==$safetensors_version" \
  "numpy==$numpy_version"
"$venv/bin/python" -c "import torch, transformers, safetensors, numpy; print('torch', \
torch.__version__, 'transformers', transformers.__version__, 'safetensors', \
safetensors.__version__, 'numpy', numpy.__version__)"
echo "run tools/make_hf_golden.py with $venv/bin/python"
