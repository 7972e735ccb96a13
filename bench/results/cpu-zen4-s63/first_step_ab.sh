#!/usr/bin/env bash
# Fresh online state, then first_step_ab.py: with the shipped engine, then with the first plain
# step after the prefill timed again (a temporary edit of engine.py, restored after).
set -euo pipefail
cd "$(dirname "$0")/../../.."
run() { rm -f ~/.cache/heterospec/costs/*.online-*; python bench/results/cpu-zen4-s63/first_step_ab.py 2>&1 | grep -v Warn; }
echo "== untimed (shipped)"; run
cp heterospec/engine.py /tmp/engine.py.keep
sed -i '0,/^            switched = True$/s//            switched = False/' heterospec/engine.py
echo "== timed (before)"; run || true
cp /tmp/engine.py.keep heterospec/engine.py
