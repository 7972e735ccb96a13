import json, statistics as S, collections, sys
recs=[json.loads(l) for l in open(sys.argv[1])]
B=int(sys.argv[2]) if len(sys.argv)>2 else 1
rows=[]
for r in recs:
    if r['batch']!=B or r['target_ms'] is None or r['max_query_len']>7: continue
    k=sum(r['k']); acc=0 if k==0 or r['rejected'] is None else k-sum(r['rejected'])
    rows.append(dict(plan=r['plan'],k=max(r['k']) if r['k'] else 0,acc=acc,draft=r['draft_ms'],warm=r['warm_ms'],ours=r['ours_ms'],tgt=r['target_ms']))
cat=collections.defaultdict(list)
for r in rows: cat[(r['plan'], min(r['k'],3))].append(r)
T=lambda r: r['draft']+r['warm']+r['ours']+r['tgt']
tot=sum(T(r) for r in rows); toks=sum(B+r['acc'] for r in rows)
print('steps',len(rows),'time s %.1f'%(tot/1e3),'tokens',toks,'tok/s %.2f'%(toks/tot*1e3))
for k,v in sorted(cat.items(), key=lambda x:str(x[0])):
    print(k, len(v), 'acc/step %.2f'%S.mean(r['acc'] for r in v), 'draft %.1f warm %.1f ours %.2f tgt med %.1f'%(
        S.mean(r['draft'] for r in v), S.mean(r['warm'] for r in v), S.mean(r['ours'] for r in v), S.median(r['tgt'] for r in v)),
        'ms/step %.1f tok/ms %.4f share %.3f'%(S.mean(T(r) for r in v), sum(B+r['acc'] for r in v)/sum(T(r) for r in v), sum(T(r) for r in v)/tot))
