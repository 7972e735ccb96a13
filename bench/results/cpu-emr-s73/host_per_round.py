"""Host work of heterospec's plain rounds at batch B (cProfile, cumulative ms per round of the
policy's and the lookup gate's entry points), after 3 warm-up calls; 3 profiled calls."""
import cProfile, pstats, sys, time, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
e = heterospec.Engine.from_pretrained()
for B in [int(x) for x in sys.argv[1:]] or [8]:
    texts = [p.text for p in load_prompts("mtbench", n=2 * B)]
    for _ in range(3):
        e.generate_batch(texts[:B], max_new_tokens=96, method="heterospec")
    pr = cProfile.Profile(); pr.enable()
    rounds = 0
    for _ in range(3):
        rs = e.generate_batch(texts[B:2 * B], max_new_tokens=96, method="heterospec")
        rounds += max(len(r.stats.records) for r in rs)
    pr.disable()
    st = pstats.Stats(pr).stats
    want = {"round_plan": "policy.py", "_lookup_choice": "engine.py", "save_state": "policy.py", "save": "lookup.py",
            "observe": "policy.py", "observe_plain": "lookup.py", "fit_plan": "policy.py", "extend": "lookup.py",
            "_decode_one": "engine.py", "_plain_step": "engine.py", "generate_batch": "engine.py", "_prefill": "engine.py"}
    out = {}
    for (f, line, name), v in st.items():
        if name in want and f.endswith(want[name]):
            out[name] = out.get(name, 0) + v[3]
    host = sum(out.get(k, 0) for k in ("round_plan", "_lookup_choice", "save_state", "save", "observe", "observe_plain"))
    dec = out["generate_batch"] - out["_prefill"]
    print(f"B={B} rounds={rounds} decode {1e3*dec/rounds:.2f} ms/round, host {1e3*host/rounds:.3f} ms/round "
          f"({100*host/dec:.2f} %): " + ", ".join(f"{k} {1e3*v/rounds:.3f}" for k, v in sorted(out.items())))
