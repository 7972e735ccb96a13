#!/usr/bin/env bash
# bfloat16 batch sweep from a fresh bfloat16 online state, on the code at hand (two-step plain
# probes, the switch step untimed) and on the code before it (git stash of policy.py/engine.py).
OUT=${1:?out dir}
rm -f ~/.cache/heterospec/costs/cpu-bfloat16-*.online-*
heterospec batch-sweep --dtype bfloat16 --batch-sizes 1 2 4 8 16 --max-new-tokens 96 --methods autoregressive heterospec --repeats 3 --out "$OUT" 2>&1 | grep -A7 "^| batch"
