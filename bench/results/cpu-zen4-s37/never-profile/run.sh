#!/bin/bash
# py-spy profile, in-process engine core: vLLM AR vs the plugin with frozen never-drafting costs, batch 8, HumanEval 16 prompts x 128
cd /work/main
PY=/tmp/heterospec-ci-vllm-venv/bin/python
export PYTHONPATH=/work/main VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=WARNING
export LD_PRELOAD=$($PY -c "import sys; sys.path.insert(0,'bench'); import vllm_compare as vc; print(vc._preload())")
for which in ar never; do
  if [ $which = ar ]; then args="--method autoregressive --k 1"; else args="--method heterospec --k 6 --options {\"costs\":\"/tmp/work/s37/vllm-humaneval-b8/costs-never-drafts.json\",\"learn\":false}"; fi
  /tmp/heterospec-ci-vllm-venv/bin/py-spy record --rate 100 --format raw -o /tmp/work/prof37/$which.txt -- \
    $PY -m heterospec.vllm_plugin generate $args --prompts /tmp/work/s37/vllm-humaneval-b8/prompts.json --batch 8 8 --max-new-tokens 128 --warmup 16 > /tmp/work/prof37/$which.out 2> /tmp/work/prof37/$which.err
done
