#!/bin/bash
# Cold-state A/B: base tables vs tables with the held-out start, fresh cache each run, AVX2 cap.
source /tmp/heterospec-ci-venv/bin/activate
export PYTHONPATH=/work/main
cd /tmp/s76
i=0
for v in "$@"; do
  i=$((i+1)); rm -rf c_$v_$i; cp -a fresh ncache_$i
  HETEROSPEC_CACHE=/tmp/s76/ncache_$i DRAFT=/tmp/s76/draft-$v python cold_trace.py mtbench,humaneval,gsm,alpaca,cnndm 4 nat_${i}_$v.json > nat_${i}_$v.log 2>&1
  python3 -c "
import json,statistics as st
c=json.load(open('nat_${i}_$v.json')); by={}
for r in c: by.setdefault(r['set'],[0,0]); by[r['set']][0]+=r['autoregressive']['total_s']; by[r['set']][1]+=r['heterospec']['total_s']
rs={s:a/h for s,(a,h) in by.items()}; print('native $i $v', ' '.join('%s %.3f'%(s[:5],x) for s,x in rs.items()), 'mean %.3f'%st.mean(rs.values()))"
done
