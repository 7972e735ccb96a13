#!/usr/bin/env bash
for i in 1 2 3; do
  for v in avx512 avx2 measured; do
    if [ $v = measured ]; then python bench/results/cpu-zen4-s62/small_rows_isa.py 2>&1 | grep rows
    else HETEROSPEC_SMALL_ROWS_ISA=$v python bench/results/cpu-zen4-s62/small_rows_isa.py 2>&1 | grep rows; fi
  done
done
