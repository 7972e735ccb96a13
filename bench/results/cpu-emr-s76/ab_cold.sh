#!/bin/bash
# Cold-state A/B: base tables vs tables with the held-out start, fresh cache each run, AVX2 cap.
source /tmp/heterospec-ci-venv/bin/activate
export PYTHONPATH=/work/main MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
cd /tmp/s76
i=0
for v in "$@"; do
  i=$((i+1)); rm -rf c_$v_$i; cp -a fresh cache_$i
  HETEROSPEC_CACHE=/tmp/s76/cache_$i DRAFT=/tmp/s76/draft-$v python cold_trace.py mtbench,humaneval,gsm,alpaca,cnndm 4 ab_${i}_$v.json > ab_${i}_$v.log 2>&1
  python3 -c "
import json,statistics as st
c=json.load(open('ab_${i}_$v.json')); by={}
for r in c: by.setdefault(r['set'],[0,0]); by[r['set']][0]+=r['autoregressive']['total_s']; by[r['set']][1]+=r['heterospec']['total_s']
rs={s:a/h for s,(a,h) in by.items()}; print('$i $v', ' '.join('%s %.3f'%(s[:5],x) for s,x in rs.items()), 'mean %.3f'%st.mean(rs.values()))"
done
