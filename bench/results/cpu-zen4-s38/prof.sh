cd /work/main
VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=WARNING LD_PRELOAD=/tmp/heterospec-ci-vllm-venv/lib/libiomp5.so \
  /tmp/heterospec-ci-vllm-venv/bin/py-spy record -r 200 -f raw -o /tmp/work/s38/prof-b1.txt -- \
  /tmp/heterospec-ci-vllm-venv/bin/python -m heterospec.vllm_plugin generate --method eagle3 --k 3 \
  --prompts /tmp/work/s38/p4.json --batch 1 --max-new-tokens 128 --warmup 16
