import json, torch, heterospec
from heterospec import engine as E
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
V = json.load(open("/tmp/s69/cmp/vllm_props.json"))
props = []
orig = E.Engine._verify
def wrapped(self, st, tree, *a, **k):
    pl = st.prefix_lens.tolist()
    v = orig(self, st, tree, *a, **k)
    tt = v.tree_tokens.tolist()[0]
    if len(tt) > 1: props.append((pl[0] + 1, tt[1]))     # root at position prefix_len; draft at +1
    return v
E.Engine._verify = wrapped
cfg = heterospec.SpecConfig(top_k=1, depth=2, total_tokens=2)
tot = {"common": 0, "same": 0, "acc_v": 0, "acc_o": 0}
for r in V:
    ids = r["prompt_ids"]
    mine = eng._encode(r["prompt"] if "prompt" in r else None, True) if False else None
    props.clear()
    out = eng.generate(ids, max_new_tokens=128, method="eagle3", config=cfg, chat=False)
    assert out.token_ids == r["out"], "outputs differ"
    full = ids + r["out"]
    ours = dict(props)
    vl = {}
    for p in r["props"]:
        if not p["draft"] or not p["draft"][0]: continue
        n_rej = p["rej"][0] if p["rej"] else 0
        last = p["pos"][-1] - n_rej            # last accepted position processed this step
        vl[last + 2] = p["draft"][0][0]        # the bonus sits at last + 1, the draft after it
    common = sorted(set(ours) & set(vl))
    common = [q for q in common if q < len(full)]
    print("first common", common[:3], [(ours[q], vl[q]) for q in common[:6]], "prompt len", len(ids))
    tot["common"] += len(common); tot["same"] += sum(ours[q] == vl[q] for q in common)
    tot["acc_v"] += sum(vl[q] == full[q] for q in common); tot["acc_o"] += sum(ours[q] == full[q] for q in common)
print(tot, {k: round(v / tot["common"], 3) for k, v in tot.items()})
