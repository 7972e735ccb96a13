"""Time of a step without drafts at batch 8, V = 49,152, interleaved: vLLM's RejectionSampler.forward
(what vLLM's speculative mode runs), the plugin's before this change (exact match, patch.verify_by_exact_match)
and with it (patch.sample_plainly_when_nothing_was_drafted), and vLLM's plain Sampler (what an
autoregressive step runs); greedy and temperature 0.8.
    python rs_zero_cost.py      # in the vLLM environment"""
import statistics, time, torch
from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from heterospec.vllm_plugin.patch import fix_cpu_expand, sample_plainly_when_nothing_was_drafted, verify_by_exact_match
torch.set_num_threads(2)
current_platform.register_triton_kernel_overrides(); fix_cpu_expand(); verify_by_exact_match()
exact_forward = RejectionSampler.forward                     # the plugin before: exact match
vllm_forward = exact_forward.__wrapped__                      # vLLM's forward (before the plugin)
sample_plainly_when_nothing_was_drafted()
V, B = 49152, 8
def meta(temp):
    return SamplingMetadata(temperature=None if temp == 0 else torch.full((B,), temp), all_greedy=temp == 0,
        all_random=temp > 0, top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(B), presence_penalties=torch.zeros(B),
        repetition_penalties=torch.ones(B), output_token_ids=[[] for _ in range(B)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())
cu = torch.zeros(B, dtype=torch.int32)
spec = SpecDecodeMetadata(draft_token_ids=torch.zeros(0, dtype=torch.int32), num_draft_tokens=[0] * B,
    cu_num_draft_tokens=cu, cu_num_sampled_tokens=torch.arange(1, B + 1, dtype=torch.int32),
    target_logits_indices=torch.zeros(0, dtype=torch.int32), bonus_logits_indices=torch.arange(B, dtype=torch.int32),
    logits_indices=torch.arange(B, dtype=torch.int32))
rs, sampler = RejectionSampler(Sampler()), Sampler()
logits = torch.randn(B, V) * 3
for temp in (0.0, 0.8):
    t = {"vllm rejection sampler": [], "plugin before (exact match)": [], "plugin (sampler alone)": [],
         "vllm sampler (autoregressive)": []}
    for rep in range(300):
        for name in t:
            x, m = logits.clone(), meta(temp)
            t0 = time.perf_counter()
            if name.startswith("vllm rejection"):
                vllm_forward(rs, spec, None, x, m)
            elif name.startswith("plugin before"):
                exact_forward(rs, spec, None, x, m)
            elif name.startswith("plugin"):
                rs(spec, None, x, m)
            else:
                sampler(x, m)
            t[name].append(time.perf_counter() - t0)
    for k, v in t.items():
        print(f"temperature {temp}: {k:30s} median {1e3 * statistics.median(v[20:]):.3f} ms per step (batch {B}, V {V})")
