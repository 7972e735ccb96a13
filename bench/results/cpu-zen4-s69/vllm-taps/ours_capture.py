import torch, heterospec
torch.set_num_threads(2)
cap = torch.load("/tmp/s69/cmp/vllm_cap.pt")
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
D = type(eng.draft); got = {}
oe = D.extend
def ext(self, input_ids, features, cache, prefix_lens, num_new, hole=None):
    if "ext_feats" not in got:
        got["ext_ids"] = input_ids.clone(); got["ext_feats"] = features.clone(); got["ext_prefix"] = prefix_lens.clone(); got["ext_num"] = num_new.clone()
    out = oe(self, input_ids, features, cache, prefix_lens, num_new, hole)
    if "ext_out" not in got: got["ext_out"] = out.clone()
    return out
D.extend = ext
ol = D.logits
def lg(self, hidden):
    out = ol(self, hidden)
    if "logits" not in got: got["logits"] = out.clone(); got["logit_hidden"] = hidden.clone()
    return out
D.logits = lg
ids = cap["prompt_ids"].tolist()
cfg = heterospec.SpecConfig(top_k=1, depth=2, total_tokens=2)
r = eng.generate(ids, max_new_tokens=4, method="eagle3", config=cfg, chat=False)
print("outputs", r.token_ids, cap["out"].tolist())
print({k: tuple(v.shape) for k, v in got.items()}, got["ext_prefix"].tolist(), got["ext_num"].tolist())
f_ours = got["ext_feats"][0]              # [n, 3H]
f_v = cap["hidden0"]
n = min(f_ours.shape[0], f_v.shape[0])
print("ext ids (ours) last 5", got["ext_ids"][0, :n][-5:].tolist(), " vllm toks shifted", cap["tok0"][-4:].tolist())
d = (f_ours[:n] - f_v[:n]).abs()
print("features: max abs diff", d.max().item(), "rel", (d.max() / f_v.abs().max()).item())
for j in range(3):
    sl = slice(576 * j, 576 * (j + 1))
    print("  tap", j, "max diff", (f_ours[:n, sl] - f_v[:n, sl]).abs().max().item(), "scale", f_v[:n, sl].abs().max().item())
# our draft vocab logits -> target vocab
lo = got["logits"].reshape(-1, got["logits"].shape[-1])[-1]
d2t = eng.draft.d2t if hasattr(eng.draft, "d2t") else None
tgt = torch.arange(lo.shape[0]) + eng.draft.d2t.long() if d2t is not None else None
lv = cap["logits0"][0]
lv_d = lv[tgt]
print("ours top5", tgt[lo.topk(5).indices].tolist(), lo.topk(5).values.tolist())
print("vllm top5", lv.topk(5).indices.tolist(), lv.topk(5).values.tolist())
print("logit max abs diff over draft vocab", (lo - lv_d).abs().max().item())
t0o, t0v = f_ours[:n, :576], f_v[:n, :576]
pd = (t0o - t0v).abs().max(dim=1).values
print("tap0 per-position max diff (first 6):", [round(x, 3) for x in pd[:6].tolist()], " max over positions >= 1:", pd[1:].max().item())
print("tap0 pos0 norms ours / vllm:", t0o[0].norm().item(), t0v[0].norm().item(), " pos1:", t0o[1].norm().item(), t0v[1].norm().item())
for j in (1, 2):
    sl = slice(576 * j, 576 * (j + 1))
    pdj = (f_ours[:n, sl] - f_v[:n, sl]).abs().max(dim=1).values
    print(f"tap{j} per-position max diff (first 4):", [round(x, 3) for x in pdj[:4].tolist()], "rest max", pdj[1:].max().item())
print("tokens: ours ext ids first 3", got["ext_ids"][0, :3].tolist(), "prompt first 3", ids[:3], "vllm tok0 first 3", cap["tok0"][:3].tolist())
