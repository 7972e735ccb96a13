#!/bin/bash
# vLLM bfloat16: where do speculative engines part from vLLM autoregressive, and is it a rounding tie?
# bash run.sh OUT (in the vLLM environment, PYTHONPATH=<this checkout>), then python ties.py OUT
set -e
OUT=${1:?usage: run.sh OUT}; mkdir -p $OUT
cd /work/main
python - <<'PY' > $OUT/prompts.json
import json
from heterospec.datasets import load_prompts
print(json.dumps([p.text for p in load_prompts("mtbench", n=8)]))
PY
for m in "autoregressive 1" "eagle3 2" "heterospec 6"; do set -- $m
  LD_PRELOAD=/tmp/heterospec-ci-vllm-venv/lib/libiomp5.so python -m heterospec.vllm_plugin generate --method $1 --k $2 \
    --batch 1 --prompts $OUT/prompts.json --executor uni --dtype bfloat16 --warmup 8 \
    --runs '[{"max_new_tokens": 128, "params": {"logprobs": 2}}]' 2>/dev/null | grep '^{' > $OUT/$1.jsonl
done
