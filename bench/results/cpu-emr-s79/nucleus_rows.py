"""processed_probs (top-p 0.95, temperature 0.8) and sample_rows on the built-in target's real logits rows."""
import time, torch, heterospec
from heterospec import datasets
from heterospec.sampling import processed_probs, sample_rows, nucleus_drop, NUCLEUS_TIERS
from heterospec.config import SamplingParams
eng = heterospec.Engine.from_pretrained()
rows = []
orig = eng.target.forward
def grab(*a, **k):
    out = orig(*a, **k); rows.append(out[0].reshape(-1, out[0].shape[-1])[:1].clone()); return out
eng.target.forward = grab
for p in datasets.load_prompts('mtbench', n=3):
    eng.generate(p.text, max_new_tokens=40, method='autoregressive', temperature=0.8, top_p=0.95, seed=1)
eng.target.forward = orig
X = torch.cat(rows)
params = SamplingParams(0.8, 0.95, 0, None)
P = torch.softmax((X - X.amax(-1, keepdim=True)) / 0.8, -1)
vals = P.sort(-1, descending=True).values.cumsum(-1)
need = (vals < 0.95).sum(-1) + 1
print('rows', X.shape[0], 'nucleus size: median', int(need.median()), 'max', int(need.max()), 'within 256:', float((need < 256).float().mean()))
def t(f, n=30):
    for _ in range(3): f()
    s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - s) / n * 1e3
print('processed_probs per row %.3f ms' % (t(lambda: processed_probs(X, params)) / X.shape[0]))
