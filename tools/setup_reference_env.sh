#!/usr/bin/env bash
# Python environment for the reference-data tools (tools/*.py); mt itself and its tests never
# need it: the data they make is committed under tests/golden/.
#
# PyPI's Linux torch wheels pull in the CUDA runtime (gigabytes), so torch comes from Debian
# (python3-torch 1.13, CPU only, ~40 s to install). The pyenv Python on PATH cannot see Debian's
# dist-packages, so the venv is built on /usr/bin/python3 with --system-site-packages.
# transformers 4.44 is the newest line that still runs on torch 1.13 and already has Llama 3.1
# rope scaling (rope_type "llama3").
#   VENV  where to create it (default: <repo>/.venv, which git ignores)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$root/.venv}
packages=(python3-torch python3-venv python3-numpy)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq >/dev/null
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
"$venv/bin/pip" install -q "transformers==4.44.2" "safetensors==0.8.0"
"$venv/bin/python" -c "import torch, transformers, safetensors; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'safetensors', safetensors.__version__)"
echo "run the tools with $venv/bin/python"
