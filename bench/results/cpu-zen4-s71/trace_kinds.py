"""Kinds of step in a vLLM + HeteroSpec trace (HETEROSPEC_VLLM_TRACE): medians, tokens, ms a token."""
import json,collections,statistics as st,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
g=collections.defaultdict(list)
for r in rows:
    if r['target_ms'] is None or r['max_query_len']>8: continue
    B=r['batch']; ks=r['k'] or []; lk=r['lookup'] or []
    draft=sum(ks)+sum(lk)
    rej=sum(r['rejected'] or [])
    out=B+draft-rej
    kind=r['plan']+('-g' if r.get('guard_plain') and not ks and not lk else '')
    if not ks and not lk and r['plan'] in('fitted',): kind='fitted-plain'+('-g' if r.get('guard_plain') else '')
    g[(B==8,kind)].append((r['target_ms'],r['draft_ms'],r['warm_ms'],r['ours_ms'],draft,out,r['tokens']))
for key in sorted(g):
    v=g[key]; n=len(v)
    tm=st.median(x[0] for x in v); dm=st.mean(x[1] for x in v); wm=st.mean(x[2] for x in v); om=st.mean(x[3] for x in v)
    dr=st.mean(x[4] for x in v); out=st.mean(x[5] for x in v)
    tot=sum(x[0]+max(x[1],x[2])+x[3] for x in v); outs=sum(x[5] for x in v)   # (a lookup step's draft_ms is its warm forward)
    print(f"{'b8' if key[0] else '<8'} {key[1]:16s} n={n:4d} target={tm:6.1f} draft={dm:5.2f} warm={wm:5.2f} ours={om:5.2f} drafted={dr:5.2f} out={out:5.2f} ms/tok={tot/outs:5.2f}")
