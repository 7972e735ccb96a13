#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")/../../.."
run() { rm -f ~/.cache/heterospec/costs/*.online-*; python bench/results/cpu-zen4-s63/sets_first_step_ab.py 2>&1 | grep -v Warn; }
for rep in 1 2; do
  echo "== untimed (shipped)"; run
  cp heterospec/engine.py /tmp/engine.py.keep
  sed -i '0,/^            switched = True$/s//            switched = False/' heterospec/engine.py
  echo "== timed (before)"; run || true
  cp /tmp/engine.py.keep heterospec/engine.py
done
