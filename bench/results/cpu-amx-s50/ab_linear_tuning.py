"""Old against new linear-layer timing, interleaved (fiftieth session).

"old" = the timing before this session's change: a warm-up pass and at least 2 timed passes in
both rounds for every path. "new" = heterospec.models.linear as committed: where a path's copies
exceed the last-level cache, round 2 has no warm-up pass and one timed pass may do. Prints, per
shape, the seconds each method took, old/new of the median readings per row count, and how
often the decisions agree between methods and between two runs of the old one.
    python bench/results/cpu-amx-s50/ab_linear_tuning.py [big]
"""
import torch, statistics as st, heterospec.models.linear as L, torch.nn as nn, sys, time
new=L._best_ms
def old(fns, reps, warm_up=True): return new(fns, max(reps,2), True)
shapes=[(576,576,'q4_1'),(1152,192,'f16'),(576,1536,'f16')] + ([(576,8192,'f16')] if 'big' in sys.argv else [])
res={}; secs={}
torch.set_num_threads(2)
with torch.inference_mode():
  for rnd in range(3):
    for (K,N,fmt) in shapes:
        for name,fn in (('old',old),('new',new)):
            L._best_ms=fn; t0=time.time()
            t=L.time_shape(nn.Linear(K,N,bias=False), fmt=fmt)
            secs[(K,N,fmt,name)]=secs.get((K,N,fmt,name),0)+time.time()-t0
            res.setdefault((K,N,fmt,name),[]).append(t)
L._best_ms=new
for (K,N,fmt) in shapes:
    o=res[(K,N,fmt,'old')]; n=res[(K,N,fmt,'new')]
    print(K,N,fmt,'seconds old %.1f new %.1f'%(secs[(K,N,fmt,'old')]/3, secs[(K,N,fmt,'new')]/3))
    for path in ('stock_ms','packed_ms','stream_ms'):
        r=[st.median(a[path][i] for a in o)/st.median(b[path][i] for b in n) for i in range(len(L.TUNE_ROWS))]
        print(' ',path,'old/new', ' '.join(f'{x:.2f}' for x in r), ' median %.3f'%st.median(r))
    ag=sum(x==y for a,b in zip(o,n) for f in (L.decisions,L.stream_decisions,L.pad_decisions) for x,y in zip(f(a),f(b)))
    ao=sum(x==y for a in o for b in o if a is not b for f in (L.decisions,L.stream_decisions,L.pad_decisions) for x,y in zip(f(a),f(b)))//2
    print('  decision agreement old-vs-new', ag, '/', 3*3*len(L.TUNE_ROWS), '| old-vs-old', ao, '/', 3*3*len(L.TUNE_ROWS))
