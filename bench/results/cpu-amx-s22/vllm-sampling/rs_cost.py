"""Time of vLLM's RejectionSampler.forward at batch 8, V = 49,152, 1-2 drafts per request, temperature 0.8,
interleaved: vLLM's own path (expand fixed; the unpatched forward), and exact match
(patch.verify_by_exact_match) for unseeded and for seeded requests.
    python rs_cost.py      # in the vLLM environment"""
import time, statistics, torch
from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from heterospec.vllm_plugin.patch import verify_by_exact_match, fix_cpu_expand
torch.set_num_threads(2)
current_platform.register_triton_kernel_overrides(); fix_cpu_expand(); verify_by_exact_match()
V, B = 49152, 8
n = [1, 2, 1, 2, 1, 2, 1, 2]
def meta(gens):
    return SamplingMetadata(temperature=torch.full((B,), 0.8), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators=gens, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(B), presence_penalties=torch.zeros(B), repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)], allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
rows = sum(n) + B
tgt, bonus, off = [], [], 0
for k in n:
    tgt += list(range(off, off + k)); bonus.append(off + k); off += k + 1
cu = torch.tensor(n).cumsum(0).to(torch.int32)
spec = SpecDecodeMetadata(draft_token_ids=torch.randint(0, V, (sum(n),), dtype=torch.int32), num_draft_tokens=n,
    cu_num_draft_tokens=cu, cu_num_sampled_tokens=cu + torch.arange(1, B + 1, dtype=torch.int32),
    target_logits_indices=torch.tensor(tgt, dtype=torch.int32), bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
    logits_indices=torch.arange(rows, dtype=torch.int32))
rs = RejectionSampler(Sampler())
logits = torch.randn(rows, V) * 3
gens = {i: torch.Generator().manual_seed(i) for i in range(B)}
vllm_forward = RejectionSampler.forward.__wrapped__        # vLLM's forward, before the plugin's wrapper
t = {"vllm": [], "exact, unseeded": [], "exact, seeded": []}
for rep in range(60):
    for name, g in (("vllm", {}), ("exact, unseeded", {}), ("exact, seeded", gens)):
        t0 = time.perf_counter()
        if name == "vllm":
            vllm_forward(rs, spec, None, logits.clone(), meta(dict(g)))
        else:
            rs(spec, None, logits.clone(), meta(dict(g)))
        t[name].append(time.perf_counter() - t0)
for k, v in t.items():
    print(f"{k:16s} median {1e3 * statistics.median(v[10:]):.2f} ms per forward (batch {B}, {sum(n)} drafts, V {V})")
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(20): vllm_forward(rs, spec, None, logits.clone(), meta({}))
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
