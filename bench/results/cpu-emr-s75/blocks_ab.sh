#!/bin/bash
# Interleaved A/B of stream_linear_blocks per row count: the build at OLD_TREE against this tree,
# each run in its own process (ABBA order, PASSES passes), under the ISA cap given as ISA (avx2 or native).
# Usage: bash blocks_ab.sh OLD_TREE OUTDIR [PASSES] [ISA]
OLD=$1; OUT=$2; PASSES=${3:-3}; ISA=${4:-avx2}
HERE=$(cd "$(dirname "$0")" && pwd); NEW=$(cd "$HERE/../../.." && pwd)
mkdir -p "$OUT"
if [ "$ISA" = avx2 ]; then export MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2; fi
for i in $(seq 1 "$PASSES"); do
  order="new old"; [ $((i % 2)) = 0 ] && order="old new"
  for b in $order; do
    tree=$NEW; [ "$b" = old ] && tree=$OLD
    (cd "$tree" && PYTHONPATH=$tree python "$HERE/blocks_rows.py" "$OUT/$b-$i.json" --reps ${REPS:-12} > /dev/null 2>&1)
  done
done
python - "$OUT" "$PASSES" <<'PY'
import json, sys
out, n = sys.argv[1], int(sys.argv[2])
runs = {b: [json.load(open(f"{out}/{b}-{i}.json"))["ms"] for i in range(1, n + 1)] for b in ("new", "old")}
best = {b: {k: min(r[k] for r in runs[b]) for k in runs[b][0]} for b in runs}
json.dump(best, open(f"{out}/best.json", "w"), indent=1)
print(f"{'shape/rows':14s} {'old ms':>8s} {'new ms':>8s} {'new/old':>8s}")
for k in best["new"]:
    print(f"{k:14s} {best['old'][k]:8.3f} {best['new'][k]:8.3f} {best['new'][k]/best['old'][k]:8.3f}")
PY
