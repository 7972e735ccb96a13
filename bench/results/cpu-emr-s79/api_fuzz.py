"""Bad input to Engine.generate / generate_batch on the built-in pair: what each raises (run before the fixes)."""
import torch, heterospec, traceback, math
eng = heterospec.Engine.from_pretrained()
cases = {
 'empty str': lambda: eng.generate("", max_new_tokens=4),
 'empty list': lambda: eng.generate([], max_new_tokens=4),
 'max_new 0': lambda: eng.generate("hi", max_new_tokens=0),
 'max_new -1': lambda: eng.generate("hi", max_new_tokens=-1),
 'max_new float': lambda: eng.generate("hi", max_new_tokens=2.5),
 'max_new huge': lambda: eng.generate("hi", max_new_tokens=10**9),
 'token oob': lambda: eng.generate([1, 2, 10**6], max_new_tokens=4),
 'token neg': lambda: eng.generate([1, -2], max_new_tokens=4),
 'tensor 2d': lambda: eng.generate(torch.tensor([[1, 2]]), max_new_tokens=4),
 'tensor float': lambda: eng.generate(torch.tensor([1.0, 2.0]), max_new_tokens=4),
 'temp nan': lambda: eng.generate("hi", max_new_tokens=4, temperature=float('nan')),
 'temp inf': lambda: eng.generate("hi", max_new_tokens=4, temperature=float('inf')),
 'temp neg': lambda: eng.generate("hi", max_new_tokens=4, temperature=-1),
 'top_p 0': lambda: eng.generate("hi", max_new_tokens=4, temperature=1, top_p=0),
 'top_p 1.5': lambda: eng.generate("hi", max_new_tokens=4, temperature=1, top_p=1.5),
 'top_k 0 samp': lambda: eng.generate("hi", max_new_tokens=4, temperature=1, top_k=0),
 'top_k -1': lambda: eng.generate("hi", max_new_tokens=4, temperature=1, top_k=-1),
 'method bad': lambda: eng.generate("hi", max_new_tokens=4, method="foo"),
 'policy bad': lambda: eng.generate("hi", max_new_tokens=4, policy="foo"),
 'seed greedy': lambda: eng.generate("hi", max_new_tokens=4, seed=1),
 'batch empty': lambda: eng.generate_batch([], max_new_tokens=4),
 'batch with empty': lambda: eng.generate_batch(["hi", ""], max_new_tokens=4),
 'batch mixed types': lambda: eng.generate_batch(["hi", [1, 2, 3]], max_new_tokens=4),
 'very long prompt': lambda: eng.generate([1] * 9000, max_new_tokens=4),
 'chat none tok': lambda: eng.generate("hi", max_new_tokens=4, chat="yes"),
 'config bad': lambda: eng.generate("hi", max_new_tokens=4, config=heterospec.SpecConfig(top_k=0)),
 'config depth 0': lambda: eng.generate("hi", max_new_tokens=4, config=heterospec.SpecConfig(depth=0)),
 'config total 0': lambda: eng.generate("hi", max_new_tokens=4, config=heterospec.SpecConfig(total_tokens=0)),
 'config huge topk': lambda: eng.generate("hi", max_new_tokens=4, config=heterospec.SpecConfig(top_k=100000)),
 'lookup str': lambda: eng.generate("hi", max_new_tokens=4, lookup="no"),
 'eagle3 seed samp': lambda: eng.generate("hi", max_new_tokens=4, method='eagle3', temperature=0.5, seed=3),
 'stream raises': lambda: eng.generate("hi", max_new_tokens=4, stream=lambda t: 1/0) if 'stream' in eng.generate.__code__.co_varnames else 'no stream arg',
}
for name, f in cases.items():
    try:
        r = f()
        s = r if isinstance(r, str) else (f"ok: {len(r)} results" if isinstance(r, list) else f"ok: {len(r.tokens) if hasattr(r,'tokens') else '?'} tokens, finish {getattr(r,'finish_reason',None)}")
        print(f"{name:20s} {s}")
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"{name:20s} {type(e).__name__}: {str(e)[:150]}")
    except Exception as e:
        print(f"{name:20s} !!! {type(e).__name__}: {str(e)[:150]}")
