#!/bin/bash
# py-spy profile of vLLM AR vs the plugin with frozen never-draft costs, batch 8, one engine at a time
cd /work/main
PY=/tmp/vllm-venv/bin/python
export LD_PRELOAD=$($PY -c "import sys; sys.path.insert(0,'bench'); import vllm_compare as vc; print(vc._preload())")
for which in ar never; do
  if [ $which = ar ]; then args="--method autoregressive --k 1"; else args="--method heterospec --k 6 --options {\"costs\":\"/tmp/work/prof23/costs-never-drafts.json\",\"learn\":false}"; fi
  /tmp/vllm-venv/bin/py-spy record --subprocesses --rate 100 --format raw -o /tmp/work/prof23/$which.txt -- \
    $PY -m heterospec.vllm_plugin generate $args --prompts /tmp/work/prompts24.json --batch 8 --max-new-tokens 128 --warmup 16 --memory-fraction 0.127 > /tmp/work/prof23/$which.out 2> /tmp/work/prof23/$which.err
done
echo done > /tmp/work/prof23/DONE
