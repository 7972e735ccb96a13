import torch, time
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
torch.set_num_threads(2)
eng = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
for rep in range(3):
    r = eng.generate_batch(prompts[:1], max_new_tokens=96, **bench_call("heterospec"))
    pol = eng._policy("heterospec", eng.config, eng.policy)
    print("rep", rep, "realized", [round(x, 4) for x in pol._realized.get(1, [])], "verdict", pol._verdict(1), "loses", pol.realized_loses(1))
    plan = pol.fitted_plan(1, 256)
    print("  plan speculate", plan.speculate, "expected", {k: v for k, v in (plan.expected or {}).items() if k in ("speculative", "plain")})
    print("  time_scale", pol.time_scale(1), "plain_scale", pol.plain_scale(1), "prior", pol._speculative_prior(1))
