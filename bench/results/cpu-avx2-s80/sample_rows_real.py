"""The keyed draw on the built-in target's real logits rows (MT-bench, temperature 0.8, top-p 0.95 and
1.0): the sample_tokens op against the composed path it replaced (processed_probs then sample_rows),
interleaved in one process, per row and per 4-row tree; tokens compared. Beside them the greedy pick."""
import statistics, time, torch, heterospec
from heterospec import datasets, ops
from heterospec.sampling import processed_probs, sample_rows, greedy_tokens
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
X = torch.cat(rows)[:96]
g = torch.Generator().manual_seed(0)
U = torch.rand(X.shape[0], generator=g, dtype=torch.float64)
print('rows', X.shape[0], 'threads', torch.get_num_threads())

def per_call(f, reps=5):
    f(); t = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t) / reps * 1e3

for top_p in (0.95, 1.0):
    params = SamplingParams(temperature=0.8, top_p=top_p)
    a, b = sample_rows(processed_probs(X, params), U)[0], ops.sample_tokens(X, U, 0.8, 0, top_p)[0]
    print(f'top_p {top_p}: tokens equal on {int((a == b).sum())} of {len(a)} rows')
    for R in (1, 4):
        comp, op = [], []
        for i in range(0, 48, R):                                  # interleaved, row group by row group
            x, u = X[i:i + R], U[i:i + R]
            comp.append(per_call(lambda: sample_rows(processed_probs(x, params), u)))
            op.append(per_call(lambda: ops.sample_tokens(x, u, 0.8, 0, top_p)))
        c, o = statistics.median(comp), statistics.median(op)
        print(f'  {R} row(s): composed {c:.3f} ms, op {o:.3f} ms ({c / o:.1f}x)')
gr = statistics.median(per_call(lambda: greedy_tokens(X[i:i + 1])) for i in range(48))
print(f'greedy pick, 1 row: {gr:.3f} ms')
