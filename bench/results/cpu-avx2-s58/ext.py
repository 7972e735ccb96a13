import torch, time
from heterospec import Engine
from heterospec.config import SamplingParams
from heterospec.policy import Eagle3Policy
torch.set_num_threads(2)
eng = Engine.from_pretrained()
cfg = eng.config
g = torch.Generator().manual_seed(0)
prompt = [torch.randint(0, 49152, (256,), generator=g).tolist()]
with torch.inference_mode():
    st = eng._prefill(prompt, "eagle3", SamplingParams(), None, 256 + 200, 10**9, None, draft_prompt=False)
    toks0, feats0 = st.ext_tokens, st.ext_feats
    plan = Eagle3Policy(cfg.replace(depth=0)).plan(1)
    def run(n):
        st.ext_tokens, st.ext_feats = toks0[:, :n].clone(), feats0[:, :n].clone()
        st.ext_num = torch.full((1,), n, dtype=torch.int64); st.draft_lens = st.prefix_lens - n
        eng._draft_tree(st, cfg.replace(depth=0), plan)
    for rep in range(2):
        for n in (1, 2, 4, 8, 16, 24, 32):
            best = 1e9
            for _ in range(15):
                t = time.perf_counter(); run(n); best = min(best, time.perf_counter() - t)
            print(n, "%.2f ms" % (best * 1e3), end="; ")
        print()
