#!/usr/bin/env bash
# The batch-1 sweep after a long-context set, from a fresh online state: run once on the code with
# the guard's context scaling and once on the code before it (git stash of policy.py / engine.py).
set -e
OUT=${1:?out dir}
rm -f ~/.cache/heterospec/costs/*.online-*
heterospec bench --methods autoregressive heterospec --sets cnndm --n 4 --max-new-tokens 128 --out "$OUT/cnndm" 2>&1 | grep -A4 "^| set" | tail -3
heterospec batch-sweep --batch-sizes 1 --max-new-tokens 96 --methods autoregressive heterospec --repeats 4 --out "$OUT/sweep-b1" 2>&1 | grep -A3 "^| batch"
