#!/usr/bin/env bash
# isa_ar.py three times in each instruction set, alternated.
for i in 1 2 3; do
  python bench/results/cpu-zen4-s62/isa_ar.py 2>&1 | grep "tok/s"
  MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/results/cpu-zen4-s62/isa_ar.py 2>&1 | grep "tok/s"
done
