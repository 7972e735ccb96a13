"""Per kind of vLLM + HeteroSpec step (a HETEROSPEC_VLLM_TRACE file): steps, target and draft ms,
accepted tokens, tokens per ms. Usage: python vllm_trace_summary.py trace.jsonl"""
import json, collections, sys
L=[json.loads(l) for l in open(sys.argv[1])]
L=[x for x in L if x['plan']]
by=collections.defaultdict(list)
for x in L:
    if x.get('lookup'):
        k=x['lookup'][0]; kind='lookup%d'%k
    else:
        k = x['k'][0] if x['k'] else 0; kind='k%d'%k
    acc = (k-x['rejected'][0]) if x['rejected'] else 0
    by[kind].append((x['target_ms'] or 0, x['draft_ms'], acc, x['tokens']))
tt=0;tok=0
for k,v in sorted(by.items()):
    n=len(v); t=sum(a+b for a,b,_,_ in v)/n
    acc=sum(c for _,_,c,_ in v)/n
    print(k, n, "target %.1f draft %.1f total %.1f acc %.2f  tok/ms %.4f" % (sum(a for a,_,_,_ in v)/n, sum(b for _,b,_,_ in v)/n, t, acc, (1+acc)/t))
    tt+=t*n; tok+=(1+acc)*n
print("overall tok/s %.1f steps %d tokens %d" % (1000*tok/tt, len(L), tok))
