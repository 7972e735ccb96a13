"""The pieces of a cold plain step after a real forward, timed one by one (53rd session; the code
before _cold_step): each small op costs 10-30 us right after a forward:
    python bench/results/cpu-amx-s53/cold_step_parts.py 4 100
"""
import sys, time, statistics, torch

from heterospec.config import SamplingParams
from heterospec.engine import RoundRecord
from heterospec.sampling import make_generator
from _setup import benchmark_prompts, engine
B, n = int(sys.argv[1]), int(sys.argv[2])
eng = engine("float32")
ids = [eng._encode(p, True) for p in benchmark_prompts()[:B]]
params, gen = SamplingParams(), make_generator(None, eng.device)
parts = {"clone": [], "forget": [], "ext": [], "records": [], "emit": [], "hostlens": []}
with torch.inference_mode():
    st = eng._prefill(ids, "heterospec", params, gen, max(map(len, ids)) + 2 * n + 80, 10 ** 6, None, True, defer_prompt=True)
    for i in range(n):
        root, feat = eng._plain_step(st, params, gen, True)
        t0 = time.perf_counter(); stepped = st.prefix_lens.clone(); st.prefix_lens += 1; t1 = time.perf_counter()
        st.host_lens = [x + 1 for x in st.host_lens]; st.root = root; t2 = time.perf_counter()
        eng._forget_all_pending(st, stepped); t3 = time.perf_counter()
        st.ext_tokens, st.ext_feats = root[:, None], feat[:, None].to(st.ext_feats.dtype); st.ext_num = torch.ones_like(st.ext_num); t4 = time.perf_counter()
        for b in st.active():
            s = st.stats[b]; s.target_calls += 1
            s.records.append(RoundRecord(accept_len=0, verified=1, depth=0, entropy=float("nan"), bin=-1, tcr=1, pstar_rank=0, pstar_accepted=False, draft_s=0.0, verify_s=0.01, plain=True))
        t5 = time.perf_counter()
        eng._emit(st, [[int(t)] for t in st.root.tolist()], 10 ** 6, None); t6 = time.perf_counter()
        for k, a, b in (("clone", t0, t1), ("hostlens", t1, t2), ("forget", t2, t3), ("ext", t3, t4), ("records", t4, t5), ("emit", t5, t6)):
            parts[k].append(b - a)
print(B, {k: "%.1f us" % (1e6 * statistics.median(v)) for k, v in parts.items()})
