"""In-process A/B of a host-path change: heterospec float32 batch 1, the same prompts, variants
alternated per prompt (ABBA); host time per round outside the models' forwards, and tok/s.
Usage: host_ab.py VARIANT [n]   (VARIANT: a name below)."""
import time, torch, heterospec, sys, functools
from heterospec.bench import load_prompt_sets
from heterospec import datastore, engine as E
from clocks import Timers, forward_clock
torch.set_num_threads(2)
eng = heterospec.Engine.from_pretrained(dtype=torch.float32)
inside = forward_clock(eng)

# -- variants: (name -> (install new, install old)) ------------------------------------------
def old_lookup(self, context, k):
    ctx = torch.tensor(list(context[-self.NMAX:]), dtype=torch.int64)
    chain, match = torch.ops.heterospec.corpus_lookup.default(self._tokens, self._order, ctx, k, self.MIN_MATCH,
                                                              self.NMAX, self.SAMPLE, float(self.AGREE))
    return [t for t in chain.tolist() if t >= 0], match.tolist()
new_lookup = datastore.CorpusIndex.lookup
VARIANTS = {
    "corpus_buffer": (lambda: setattr(datastore.CorpusIndex, "lookup", new_lookup),
                      lambda: setattr(datastore.CorpusIndex, "lookup", old_lookup)),
}
extra = {}
try:
    import host_ab_variants          # optional: more variants next to this script
    VARIANTS.update(host_ab_variants.VARIANTS)
except ImportError:
    pass
new, old = VARIANTS[sys.argv[1]]
sets = load_prompt_sets(["mtbench", "alpaca"], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
ps = [p.text for s in sets.values() for p in s]
for inst in (new, old):
    inst(); eng.generate(ps[0], max_new_tokens=16)
tot = {"new": [0.0, 0.0, 0, 0], "old": [0.0, 0.0, 0, 0]}
for i, p in enumerate(ps):
    for name in (("new", "old") if i % 2 == 0 else ("old", "new")):
        (new if name == "new" else old)()
        inside[0] = 0.0
        t = time.perf_counter(); r = eng.generate(p, max_new_tokens=96); dt = time.perf_counter() - t
        T = tot[name]; T[0] += dt; T[1] += inside[0]; T[2] += len(r.token_ids); T[3] += len(r.stats.records)
for name, (w, f, n, rounds) in tot.items():
    print(f"{sys.argv[1]} {name}: {n/w:6.1f} tok/s, host {1e3*(w-f)/rounds:.3f} ms/round ({rounds} rounds, tau {n/rounds:.3f})")
