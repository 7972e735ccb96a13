#!/bin/bash
# Cold-state A/B: base tables vs tables with the held-out start, a fresh cache each run.
# ISA=cap (default): under the AVX2 cap, files ab_<i>_<v>.*; ISA=native: files nat_<i>_<v>.*.
# Usage: [ISA=native] ./ab_cold.sh base ho ho base base ho    (draft-base / draft-ho: copies of the draft)
source /tmp/heterospec-ci-venv/bin/activate
export PYTHONPATH=/work/main
if [ "${ISA:-cap}" = cap ]; then export MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2; tag=ab; else tag=nat; fi
cd /tmp/s76
i=0
for v in "$@"; do
  i=$((i+1)); rm -rf ${tag}cache_$i; cp -a fresh ${tag}cache_$i
  HETEROSPEC_CACHE=/tmp/s76/${tag}cache_$i DRAFT=/tmp/s76/draft-$v python cold_trace.py mtbench,humaneval,gsm,alpaca,cnndm 4 ${tag}_${i}_$v.json > ${tag}_${i}_$v.log 2>&1
  python3 -c "
import json,statistics as st
c=json.load(open('${tag}_${i}_$v.json')); by={}
for r in c: by.setdefault(r['set'],[0,0]); by[r['set']][0]+=r['autoregressive']['total_s']; by[r['set']][1]+=r['heterospec']['total_s']
rs={s:a/h for s,(a,h) in by.items()}; print('${ISA:-cap} $i $v', ' '.join('%s %.3f'%(s[:5],x) for s,x in rs.items()), 'mean %.3f'%st.mean(rs.values()))"
done
