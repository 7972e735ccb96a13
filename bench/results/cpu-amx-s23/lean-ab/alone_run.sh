#!/bin/bash
# One vLLM engine at a time (no other engine alive): vLLM AR, plugin never-drafts with lean steps on / off.
cd /work/main
PY=/tmp/vllm-venv/bin/python
export LD_PRELOAD=/tmp/vllm-venv/lib/libiomp5.so VLLM_LOGGING_LEVEL=WARNING
C=/tmp/work/prof23/costs-never-drafts.json
for order in 1 2; do
  if [ $order = 1 ]; then seq="ar lean off"; else seq="off lean ar"; fi
  for w in $seq; do
    case $w in
      ar) args=(--method autoregressive --k 1);;
      lean) args=(--method heterospec --k 6 --options "{\"costs\":\"$C\",\"learn\":false}");;
      off) args=(--method heterospec --k 6 --options "{\"costs\":\"$C\",\"learn\":false,\"lean_steps\":false}");;
    esac
    $PY -m heterospec.vllm_plugin generate "${args[@]}" --prompts /tmp/work/prompts24.json --batch 8 --max-new-tokens 128 --warmup 16 --memory-fraction 0.127 2>/dev/null | grep '^{' | python3 -c "
import json,sys
for l in sys.stdin:
    o=json.loads(l); print('$order $w', o['batch'], o['tokens'], round(o['seconds'],2), round(o['tokens']/o['seconds'],2), hash(str(o['token_ids'])) % 10**8, flush=True)"
  done
done
echo done
