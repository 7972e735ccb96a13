"""Where a lookup round's time goes: _lookup_tree, _verify, _commit wall times per lookup round (2-node and
longer), against the engine's own tree rounds' _verify of the same node count. SET N."""
import sys, time, statistics as st, torch, heterospec
from heterospec import engine as E
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
log = []
cur = {}
def wrap(name):
    f = getattr(E.Engine, name)
    def g(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return f(self, *a, **k)
        finally:
            cur[name] = cur.get(name, 0.0) + time.perf_counter() - t0
    setattr(E.Engine, name, g)
for nm in ("_lookup_tree", "_verify", "_commit", "_lookup_choice"):
    wrap(nm)
orig_commit = E.Engine._commit
def commit(self, st_, tree, verdict, *a, lookup=False, **k):
    out = orig_commit(self, st_, tree, verdict, *a, lookup=lookup, **k)
    rec = st_.stats[0].records[-1]
    log.append({"nodes": int(tree.budget.max()) + 1, "lookup": lookup, "rec_verify": rec.verify_s, "rec_draft": rec.draft_s, **cur})
    cur.clear()
    return out
E.Engine._commit = commit
s, n = sys.argv[1], int(sys.argv[2])
e = heterospec.Engine.from_pretrained()
tf = type(e.target).forward
def tforward(self, *a, **k):
    t0 = time.perf_counter()
    try:
        return tf(self, *a, **k)
    finally:
        cur["target"] = cur.get("target", 0.0) + time.perf_counter() - t0
type(e.target).forward = tforward
texts = [p.text for p in load_prompts(s, n=n)]
e.generate(texts[0], max_new_tokens=16, method="heterospec")
log.clear()
for t in texts:
    cur.clear()
    e.generate(t, max_new_tokens=128, method="heterospec")
    cur.clear()
    e.generate(t, max_new_tokens=64, method="eagle3")
    cur.clear()
by = {}
for r in log:
    by.setdefault((r["lookup"], r["nodes"]), []).append(r)
for k, rs in sorted(by.items()):
    print(k, "nodes n=%d" % len(rs), " ".join("%s %.2f" % (nm, 1e3 * st.median(r.get(nm, 0.0) for r in rs)) for nm in ("_lookup_tree", "_verify", "target", "_commit", "rec_verify", "rec_draft")))
