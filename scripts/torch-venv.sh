#!/usr/bin/env bash
# A venv with a chosen torch, outside the repository, with memlayout installed beside it
# (editable) and that torch held: nothing memlayout asks for may upgrade it. Then, with
# `make test VENV=<the venv>`, the suite runs with that torch.
#
#   scripts/torch-venv.sh 2.11.0 python3.12          # -> $VENVS/torch-2.11.0-py3.12
#   make test VENV="$(scripts/torch-venv.sh 2.11.0 python3.12 | tail -1)"
#
# VENVS (default: ../venvs beside the checkout) is where venvs go; EXTRAS (default:
# dev,runtimes,models) the extras installed. PyPI's torch wheels are CUDA builds (several GB
# each); a pip.conf that caps torch (PIP_CONFIG_FILE) is ignored for this venv.
set -euo pipefail
torch_version="${1:?usage: scripts/torch-venv.sh TORCH_VERSION [PYTHON]}"
python="${2:-python3}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "$torch_version" in  # torchvision's release for each torch release
  2.10.*) vision=0.25 ;; 2.11.*) vision=0.26 ;; 2.12.*) vision=0.27 ;;
  2.13.*) vision=0.28 ;; 2.14.*) vision=0.29 ;; 2.15.*) vision=0.29.2 ;;
  *) echo "torch $torch_version: not one memlayout supports (2.10 to 2.15)" >&2; exit 2 ;;
esac
pyver="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
venvs="${VENVS:-$(dirname "$repo")/venvs}"
venv="$venvs/torch-$torch_version-py$pyver"
export PIP_CONFIG_FILE=/dev/null
if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
pins="$venv/pins.txt"
printf 'torch==%s\ntorchvision==%s.*\n' "$torch_version" "$vision" > "$pins"
"$venv/bin/python" -m pip install -q --constraint "$pins" "torch==$torch_version" "torchvision==$vision.*"
"$venv/bin/python" -m pip install -q --constraint "$pins" -e "$repo[${EXTRAS:-dev,runtimes,models}]"
touch "$venv/.memlayout-installed"
"$venv/bin/python" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)' >&2
echo "$venv"
