#!/bin/bash
# Five sets, native ISA, the shipped tables (held-out start): float32 fresh, float32 learnt, bfloat16 fresh.
source /tmp/heterospec-ci-venv/bin/activate
export PYTHONPATH=/work/main HETEROSPEC_CACHE=/tmp/s76/cache_n
cd /work/main
for run in "f32 float32" "f32-2 float32" "bf16 bfloat16"; do
  set -- $run
  python -m heterospec.cli bench --methods autoregressive eagle3 heterospec --sets mtbench humaneval gsm alpaca cnndm --n 4 --max-new-tokens 128 --dtype $2 --out bench/results/cpu-emr-s76/$1 > /tmp/s76/bench_$1.log 2>&1
done
