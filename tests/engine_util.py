"""Test doubles and tiny model pairs for the decoding-engine tests.

``OracleDraft`` implements the draft interface of docs/design.md by running a copy of the target on
each node's full context, optionally with deterministic noise on its logits. With no noise its
proposals are the target's own greedy choices, so rounds accept whole paths: that is how the tests
put EOS and ``max_new_tokens`` inside an accepted path. It is a test double, not a draft model.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Sequence, Tuple

import torch


def tiny_hf_llama(vocab: int = 96, hidden: int = 32, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                  tied: bool = False, seed: int = 0, init_range: float = 0.2, max_pos: int = 512,
                  dtype=torch.float64):
    """A random-initialised transformers Llama; a wide init gives peaked, tie-free logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, tie_word_embeddings=tied, initializer_range=init_range,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


def every_linear_streams(monkeypatch, cache_dir) -> None:
    """Have ``tune_linears`` (in a fresh cache at ``cache_dir``) time every shape's stream path
    fastest at every row count, so that tuned models take it wherever it exists."""
    from heterospec.models import linear as L
    monkeypatch.setenv("HETEROSPEC_CACHE", str(cache_dir))
    monkeypatch.setattr(L, "_MEMORY", {})
    real = L.time_shape

    def timed(layer, *a, **k):
        t = real(layer, rows=L.TUNE_ROWS, budget_s=0.01, copies=1)
        t["stream_ms"] = [1e-6] * len(t["rows"])
        return t
    monkeypatch.setattr(L, "time_shape", timed)


class _Cache:
    def __init__(self, draft: "OracleDraft", batch: int):
        self.draft, self.batch = draft, batch

    def keep_rows(self, rows: torch.Tensor) -> None:
        # the oracle keeps each request's committed context on the draft itself
        self.draft.committed = [self.draft.committed[i] for i in rows.tolist()]
        self.batch = rows.numel()


class OracleDraft(torch.nn.Module):
    """Draft double: logits = target logits on the node's context (+ seeded noise)."""

    def __init__(self, hf_model, noise: float = 0.0, seed: int = 0, sharpen: float = 1.0):
        super().__init__()
        self.hf = hf_model
        self.noise = noise
        self.seed = seed
        self.sharpen = sharpen    # scales the logits: same proposals, more confident scores
        c = hf_model.config
        self._dummy = torch.nn.Parameter(torch.zeros(1, dtype=next(hf_model.parameters()).dtype))

        class Cfg:
            hidden_size = c.hidden_size
            target_hidden_size = c.hidden_size
            vocab_size = c.vocab_size
            draft_vocab_size = c.vocab_size
        self.config = Cfg()
        self.contexts: List[Tuple[int, ...]] = []
        self.committed: List[List[int]] = []
        self.first_tokens: List[int] = []
        self._memo: Dict[Tuple[int, ...], torch.Tensor] = {}

    # The test tells the oracle each request's first prompt token (the draft never sees it).
    def set_prompts(self, prompts: Sequence[Sequence[int]]):
        self.first_tokens = [int(p[0]) for p in prompts]

    def _ctx_id(self, ctx) -> float:
        self.contexts.append(tuple(ctx))
        return float(len(self.contexts) - 1)

    def _hidden(self, ids, like):
        h = torch.zeros(len(ids), self.config.hidden_size, dtype=torch.float64)
        h[:, 0] = torch.tensor(ids, dtype=torch.float64)
        return h.to(like.device)

    def new_cache(self, batch_size, max_length):
        self.committed = [[t] for t in self.first_tokens[:batch_size]]
        return _Cache(self, batch_size)

    def extend(self, input_ids, features, cache, prefix_lens, num_new, hole=None):
        # A hole (the engine's draft_window) drops tokens from the oracle's context: the entries
        # after it extend what the oracle saw before it.
        B, n = input_ids.shape
        out = torch.zeros(B, n, self.config.hidden_size, dtype=torch.float64)
        for b in range(B):
            L = int(prefix_lens[b])
            ctx = self.committed[b][:L + 1] + [int(t) for t in input_ids[b, :int(num_new[b])]]
            self.committed[b] = ctx
            ids = [self._ctx_id(ctx[:L + 2 + j]) for j in range(int(num_new[b]))]
            out[b, :len(ids)] = self._hidden(ids, out)
        return out

    def new_tree(self, batch_size):
        return None

    def tree_step(self, input_ids, hidden, parent_slots, positions, cache, prefix_lens, state, hole=None):
        B, k = input_ids.shape
        out = torch.zeros(B, k, self.config.hidden_size, dtype=torch.float64)
        for b in range(B):
            ids = [self._ctx_id(self.contexts[int(hidden[b, j, 0])] + (int(input_ids[b, j]),)) for j in range(k)]
            out[b] = self._hidden(ids, out)
        return out

    def _noisy(self, ctx: Tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        if self.noise:
            h = int.from_bytes(hashlib.sha256(repr((self.seed, ctx)).encode()).digest()[:8], "little")
            g = torch.Generator().manual_seed(h % (2 ** 63))
            x = x + self.noise * x.std() * torch.randn(x.shape, generator=g, dtype=torch.float64)
        return x * self.sharpen

    def _fill_memo(self, ctxs) -> None:
        """One padded forward of the target copy over every context not seen yet."""
        todo = sorted({c for c in ctxs if c not in self._memo})
        for i in range(0, len(todo), 256):
            chunk = todo[i:i + 256]
            n = max(len(c) for c in chunk)
            ids = torch.zeros(len(chunk), n, dtype=torch.int64)
            att = torch.zeros(len(chunk), n, dtype=torch.int64)
            for r, c in enumerate(chunk):
                ids[r, :len(c)] = torch.tensor(c)
                att[r, :len(c)] = 1
            with torch.no_grad():
                logits = self.hf(input_ids=ids, attention_mask=att).logits.double()
            for r, c in enumerate(chunk):
                self._memo[c] = self._noisy(c, logits[r, len(c) - 1])

    def logits(self, hidden):
        flat = hidden.reshape(-1, hidden.shape[-1])
        ctxs = [self.contexts[int(v)] for v in flat[:, 0].tolist()]
        self._fill_memo(ctxs)
        return torch.stack([self._memo[c] for c in ctxs]).float().reshape(*hidden.shape[:-1], -1)

    def to_target_ids(self, draft_ids):
        return draft_ids


def stop_position(result) -> Tuple[int, int, int]:
    """Where ``result`` stopped: ``(round, i, accept_len)``, the last kept token being the ``i``-th
    (1-based) token that round emitted (its accepted drafts, then the bonus). ``round`` is -1 when
    the prefill's token was the last. The stop is inside an accepted path when
    ``1 <= i <= accept_len``; ``i == accept_len + 1`` is the bonus."""
    recs = result.stats.records
    if not recs:
        return -1, 1, 0
    before = 1 + sum(r.accept_len + 1 for r in recs[:-1])     # the prefill's token + earlier rounds
    i = len(result.token_ids) - before
    assert 1 <= i <= recs[-1].accept_len + 1, (i, recs[-1].accept_len)
    return len(recs) - 1, i, recs[-1].accept_len


def stops_inside_accepted_path(result) -> bool:
    rnd, i, accepted = stop_position(result)
    return rnd >= 0 and i <= accepted
