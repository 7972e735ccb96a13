#!/bin/bash
source /tmp/heterospec-ci-venv/bin/activate; export PYTHONPATH=/work/main
export MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
T=$HOME/.cache/heterospec/smollm2-135m-instruct
for c in "$@"; do
  d=/tmp/s77/bcache_$c; rm -rf $d; cp -a /tmp/s76/fresh $d
  DR=/tmp/s77/draft-prior; [ ${c:0:1} = F ] && DR=/tmp/s77/draft-base
  HETEROSPEC_CACHE=$d heterospec bench --target $T --draft $DR --methods autoregressive eagle3 heterospec --sets mtbench humaneval gsm alpaca cnndm --n 4 --max-new-tokens 128 --out /work/main/bench/results/cpu-emr-s77/bench-$c > /tmp/s77/bench_$c.log 2>&1
  grep -E '\*\*mean\*\* \| heterospec' /work/main/bench/results/cpu-emr-s77/bench-$c/e2e.md
done
