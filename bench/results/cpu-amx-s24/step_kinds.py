import json, collections, sys, textwrap, statistics as S
recs=[json.loads(l) for l in open(sys.argv[1])]
by=collections.defaultdict(list)
for r in recs: by[r['pid']].append(r)
for pid,rs in by.items():
    new=any('model_speculates' in r for r in rs)
    for B in (1,8):
        x=[r for r in rs if r['batch']==B and r['target_ms'] is not None and r['max_query_len']<=7 and r['target_ms']<1000]
        if not x: continue
        n=len(x); spec=sum(1 for r in x if r['k'] and max(r['k'])>0); warm=sum(1 for r in x if not (r['k'] and max(r['k'])>0) and r['warm_ms']>0.5)
        T=sum(r['target_ms']+r['draft_ms']+r['warm_ms']+r['ours_ms'] for r in x)
        tok=sum(B+(sum(r['k'])-sum(r['rejected']) if r['k'] and r['rejected'] else 0) for r in x)
        wm=[r['warm_ms'] for r in x if r['warm_ms']>0.5]
        print(pid, 'NEW' if new else 'BASE', 'B=%d steps %d spec %.2f warm-plain %.2f cold-plain %.2f  tok/ms %.4f  warm med %.1f'%(B,n,spec/n,warm/n,(n-spec-warm)/n,tok/T, S.median(wm) if wm else 0))
