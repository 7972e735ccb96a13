"""A cold plain step of heterospec against an autoregressive step, alternated on one prefilled
batch (53rd session): "feat" is the target forward with the draft's feature taps only, "cold"
the whole step as heterospec runs it (taps, the draft's hole moved, one round record),
"cold-keepnothing" the same with the kept feature copied off (no reference kept into the step):
    python bench/results/cpu-amx-s53/cold_step.py 4 150
"""
import sys, time, statistics, torch

from heterospec.config import SamplingParams
from heterospec.sampling import make_generator
from _setup import benchmark_prompts, engine
B, n = int(sys.argv[1]), int(sys.argv[2])
eng = engine("float32")
ids = [eng._encode(p, True) for p in benchmark_prompts()[:B]]
params, gen = SamplingParams(), make_generator(None, eng.device)
with torch.inference_mode():
    st = eng._prefill(ids, "heterospec", params, gen, max(map(len, ids)) + 4 * n + 80, 10 ** 6, None, True, defer_prompt=True)
    ext = st.ext_tokens
    t = {"ar": [], "feat": [], "cold": [], "cold-keepnothing": []}
    for i in range(n):
        for k in list(t)[i % 4:] + list(t)[:i % 4]:
            st.ext_tokens = None if k == "ar" else ext
            t0 = time.perf_counter()
            if k == "feat":
                root, feat = eng._plain_step(st, params, gen, True); st.prefix_lens += 1; st.root = root; del feat
            elif k == "cold-keepnothing":
                eng._decode_one(st, params, gen, 10 ** 6, None, record=True, cold=True)
                st.ext_feats = st.ext_feats.clone()
            else:
                eng._decode_one(st, params, gen, 10 ** 6, None, record=k == "cold", cold=k != "ar")
            t[k].append(time.perf_counter() - t0)
            if k != "ar": ext = st.ext_tokens
for k in list(t)[1:]:
    d = [1e6 * (c - a) for a, c in zip(t["ar"], t[k])]
    print("B=%d ar %.2f ms: %s - ar median %+.0f us, mean %+.0f" % (B, 1e3 * statistics.median(t["ar"]), k, statistics.median(d), statistics.mean(d)))
