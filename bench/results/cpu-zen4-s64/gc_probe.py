import gc, time, glob, os, sys
for f in glob.glob(os.path.expanduser("~/.cache/heterospec/costs/*.online-*")): os.remove(f)
ev = []; t0 = [0.0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else: ev.append((info["generation"], round(1e3 * (time.perf_counter() - t0[0]), 1), info["collected"]))
gc.callbacks.append(cb)
from heterospec import Engine
from heterospec.bench import load_prompt_sets, bench_call
eng = Engine.from_pretrained()
sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
prompts = [p.text for ps in sets.values() for p in ps]
print("gc during load:", [e for e in ev if e[1] > 5], "objects", len(gc.get_objects()), gc.get_count(), gc.get_threshold())
ev.clear()
if "--freeze" in sys.argv: gc.freeze()
t = time.perf_counter(); r = eng.generate_batch(prompts[:1], max_new_tokens=8, **bench_call("heterospec"))[0]; print("first hs call %.1f ms" % (1e3 * (time.perf_counter() - t)))
print([(round(1e3*x.draft_s,1), round(1e3*x.verify_s,1), x.plain) for x in r.stats.records])
print("gc during call:", ev)
