#!/usr/bin/env bash
# The eightieth session's measurements on a 2-vCPU AMD EPYC (Zen 3) with `avx2` and no AVX-512,
# run one after another on an otherwise idle box. OLD = the session's start (d42d292, the CI
# clone's build), NEW = this tree. Each run logs to $LOG.
set -u
OLD=${OLD:-/tmp/ci-clone1}
NEW=${NEW:-/work/main}
OUT=${OUT:-/work/main/bench/results/cpu-avx2-s80}
LOG=${LOG:-/tmp/s80/run_all.log}
cli() { local tree=$1; shift; (cd "$tree" && PYTHONPATH="$tree" python -m heterospec.cli "$@"); }
stamp() { echo "=== $(date +%T) $*" >> "$LOG"; }
grep -o 'avx512_bf16\|avx2\|avx512f\|amx[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' ' >> "$LOG"; echo >> "$LOG"
rm -rf ~/.cache/heterospec/costs          # a fresh state: linear choices and cost model measured here
# 1. the five sets, greedy, float32 (the state of issue 10 on a real AVX2-only CPU)
stamp greedy five sets; cli "$NEW" bench --sets mtbench humaneval gsm alpaca cnndm --n 4 --max-new-tokens 96 \
  --out "$OUT/bench-greedy" >> "$LOG" 2>&1
# 2. the same, sampled (temperature 0.8, top-p 0.95)
stamp sampled five sets; cli "$NEW" bench --sets mtbench humaneval gsm alpaca cnndm --n 4 --max-new-tokens 96 \
  --temperature 0.8 --top-p 0.95 --out "$OUT/bench-sampled" >> "$LOG" 2>&1
# 3. the keyed-draw op, A/B: the session's start against this tree, sampled, alternating (ABAB)
for rep in 1 2; do
  for code in old new; do
    tree=$OLD; [[ $code == new ]] && tree=$NEW
    stamp "sampled A/B $code $rep"; cli "$tree" bench --methods autoregressive heterospec --sets mtbench humaneval \
      --n 3 --max-new-tokens 96 --temperature 0.8 --top-p 0.95 --out "/tmp/s80/ab-sampled-$code-$rep" >> "$LOG" 2>&1
  done
done
# 4. bfloat16 on this CPU (no native bf16): the linear timings' fix, A/B (ABAB)
for rep in 1 2; do
  for code in old new; do
    tree=$OLD; [[ $code == new ]] && tree=$NEW
    stamp "bf16 A/B $code $rep"; cli "$tree" bench --dtype bfloat16 --methods autoregressive heterospec \
      --sets mtbench alpaca --n 3 --max-new-tokens 96 --out "/tmp/s80/ab-bf16-$code-$rep" >> "$LOG" 2>&1
  done
done
stamp done
