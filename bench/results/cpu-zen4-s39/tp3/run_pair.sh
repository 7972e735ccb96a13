#!/bin/bash
# AR and HeteroSpec at TP 3, training paused meanwhile
TPID=$(pgrep -f 'train-draft train' | head -1)
[ -n "$TPID" ] && kill -STOP $TPID
cd /work/main
N=$1; T=$2; TAG=$3
export VLLM_LOGGING_LEVEL=WARNING VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONPATH=/work/main
[ -f /tmp/work/s39/tp/ar-$N-$T.out ] || timeout 1200 /tmp/heterospec-ci-vllm-venv/bin/python /tmp/work/s39/tp/tp.py ar 3 $N $T > /tmp/work/s39/tp/ar-$N-$T.out 2> /tmp/work/s39/tp/ar-$N-$T.err
rm -f /tmp/work/s39/tp/trace-$TAG.jsonl
HETEROSPEC_VLLM_TRACE=/tmp/work/s39/tp/trace-$TAG.jsonl DRAFT=/tmp/work/s39/tp/draft-tp3 timeout 1200 /tmp/heterospec-ci-vllm-venv/bin/python /tmp/work/s39/tp/tp.py hs 3 $N $T > /tmp/work/s39/tp/hs-$TAG.out 2> /tmp/work/s39/tp/hs-$TAG.err
echo rc $?
[ -n "$TPID" ] && kill -CONT $TPID
python - <<PY
import json, collections
a=[json.loads(l) for l in open('/tmp/work/s39/tp/ar-$N-$T.out') if l.startswith('{')][0]
h=[json.loads(l) for l in open('/tmp/work/s39/tp/hs-$TAG.out') if l.startswith('{')][0]
print('ar', round(a['start_s']), round(a['gen_s']), 'hs', round(h['start_s']), round(h['gen_s']), 'equal', a['ids']==h['ids'], [len(x) for x in a['ids']])
rows=[json.loads(l) for l in open('/tmp/work/s39/tp/trace-$TAG.jsonl')]
by=collections.defaultdict(list)
for r in rows: by[r['pid']].append(r)
for pid, rs in by.items():
    print(pid, len(rs), dict(collections.Counter(r['plan'] for r in rs)), 'k', sum(sum(r['k']) for r in rs), 'lookup', sum(1 for r in rs if r['lookup']), 'pathstop', sum(1 for r in rs if r['path_stop']), 'rej', sum(sum(r['rejected'] or []) for r in rs))
PY
