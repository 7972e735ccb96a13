#!/bin/bash
# vLLM at temperature 0.8 (no seeds), batch 8, the first 8 MT-bench questions x 128 tokens, engines one
# at a time, order rotated per pass. Run in the vLLM environment (scripts/setup-vllm.sh) from the repo root.
#   bash bench/results/cpu-amx-s22/vllm-sampled/run.sh OUT_DIR
set -u
out=${1:-/tmp/vllm-sampled}; mkdir -p "$out"
here=$(dirname "$0")
common=(--prompts "$here/prompts.json" --batch 8 --max-new-tokens 128 --temperature 0.8 --warmup 16)
run() { # name, args...
  local name=$1; shift
  VLLM_LOGGING_LEVEL=WARNING python -m heterospec.vllm_plugin generate "${common[@]}" "$@" \
    | grep '^{' | sed "s/^{/{\"engine\": \"$name\", \"pass\": $pass, /" >> "$out/runs.jsonl"
}
for pass in 1 2; do
  if [ $pass = 1 ]; then order="ar eagle3 hs"; else order="hs eagle3 ar"; fi
  for e in $order; do
    case $e in
      ar) run "vLLM autoregressive" --method autoregressive ;;
      eagle3) run "vLLM eagle3 K=1" --method eagle3 --k 1 ;;
      hs) run "vLLM + HeteroSpec" --method heterospec --k 6 --options "{\"costs\": \"$out/costs.json\"}" ;;
    esac
  done
done
