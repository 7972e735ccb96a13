#!/bin/bash
cd /work/main
PY=/tmp/vllm-venv/bin/python
export LD_PRELOAD=/tmp/vllm-venv/lib/libiomp5.so
/tmp/vllm-venv/bin/py-spy record --subprocesses --rate 100 --format raw -o /tmp/work/prof23/lean.txt -- \
  $PY -m heterospec.vllm_plugin generate --method heterospec --k 6 --options '{"costs":"/tmp/work/prof23/costs-never-drafts.json","learn":false}' --prompts /tmp/work/prompts24.json --batch 8 --max-new-tokens 128 --warmup 16 --memory-fraction 0.127 > /tmp/work/prof23/lean.out 2> /tmp/work/prof23/lean.err
echo done > /tmp/work/prof23/DONE2
