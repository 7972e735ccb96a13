"""EAGLE-3 draft training on self-distillation shards (``heterospec.train.distill``).

Pipeline pieces, all usable from Python and from ``heterospec train-draft``:

* ``build_vocab(data_dir, size)``: the draft vocabulary = the ``size`` most frequent target
  tokens in the distilled *responses* (eagle-mechanics §3.3): ``kept`` sorted ascending,
  ``d2t[i] = kept[i] - i``, ``t2d[v] = v in kept``; with coverage of 4096 / 8192 / 12288 / size.
* ``DataStream``: shards are read in *groups* (a few shards at a time, memory-bounded); within a
  group, sequences are bucketed by length into batches of at most ``batch_tokens`` padded tokens
  and shuffled. Shards that appear while training runs join the next groups of the current
  epoch (the distillation job may still be running). Its state (epoch, shards seen, current group,
  batch index) goes into every checkpoint, so a resumed run continues at the same batch.
* ``Trainer``: ``Eagle3Draft.for_target`` (H3's model), lm_head initialised from the target's
  (tied) output embedding rows of the draft vocabulary and ``norm`` from the target's final norm;
  loss = sum over training-time-test steps s of ``0.8**s`` x soft cross-entropy against the
  target distribution restricted to the draft vocabulary (renormalised), on response positions
  whose target greedy token is in the draft vocabulary. Target logits are recomputed from the
  stored final normed hidden state with the target's lm_head rows of the draft vocabulary.
  AdamW (0.9, 0.95), linear warmup then cosine decay to 10 %, grad clip. Checkpoints hold the
  draft, optimizer, step, data position and RNG state (atomic writes).
* ``simulate_acceptance``: offline estimate of the mean acceptance length tau on held-out
  greedy distilled sequences: the draft runs exactly as in decoding (``extend`` over committed
  entries, EAGLE-2 tree expansion with ``tree_step``, rerank to ``nodes`` draft tokens), and the
  target's greedy choices are the recorded next tokens. ``top_k=1, nodes=depth`` is a chain.
* ``export_draft``: ``save_pretrained`` (public EAGLE-3 layout, fp16) into the assets dir.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import default_ttt_steps
from .distill import DistillShard, Sequence_, list_shards

__all__ = [
    "build_vocab",
    "load_vocab",
    "vocab_maps",
    "is_val",
    "DataStream",
    "TrainConfig",
    "Trainer",
    "simulate_acceptance",
    "export_draft",
    "load_target_for_training",
    "load_draft",
    "conditional_acceptance",
]

# ----------------------------------------------------------------------------- vocabulary


def vocab_maps(kept: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the sorted kept target ids: target = draft + d2t[draft]; t2d[v] = kept."""
    kept = torch.as_tensor(kept, dtype=torch.long).sort().values
    d2t = kept - torch.arange(kept.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def token_counts(data_dir, vocab_size: int, shards=None, response_only: bool = True,
                 exclude_val: bool = True) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in (shards if shards is not None else list_shards(data_dir)):
        sh = DistillShard(path)
        for i in range(len(sh)):
            if exclude_val and is_val(sh.prompt_ids[i]):
                continue
            a, b = int(sh.seq_offsets[i]), int(sh.seq_offsets[i + 1])
            start = a + int(sh.prompt_lens[i]) if response_only else a
            counts += torch.bincount(sh.tokens[start:b], minlength=vocab_size)
    return counts


def build_vocab(data_dir, size: int = 8192, vocab_size: int | None = None, out=None,
                report_sizes=(2048, 4096, 8192, 12288)) -> dict:
    """Pick the ``size`` most frequent response tokens (training split) and save them.

    Writes ``out`` (default ``DATA/vocab_SIZE.json``) with ``kept`` (sorted target ids) and
    coverage figures on the training split and on the held-out split."""
    data_dir = Path(data_dir)
    if vocab_size is None:
        vocab_size = json.loads((data_dir / "manifest.json").read_text())["vocab_size"]
    counts = token_counts(data_dir, vocab_size)
    held = token_counts(data_dir, vocab_size, exclude_val=False) - counts
    # ties (notably tokens never seen in a response, when size > distinct response tokens) are
    # broken by the count over whole sequences (prompts included), then by token id
    every = token_counts(data_dir, vocab_size, response_only=False)
    key = counts * (int(every.max()) + 1) + every
    order = torch.argsort(key, descending=True, stable=True)
    total, htotal = int(counts.sum()), int(held.sum())
    if total == 0:
        raise ValueError(f"no response tokens found in {data_dir}")
    cov = {}
    for n in sorted(set(report_sizes) | {size}):
        top = order[:n]
        cov[str(n)] = {"train": float(counts[top].sum()) / total,
                       "heldout": float(held[top].sum()) / max(1, htotal)}
    kept = order[:size].sort().values
    info = {"size": size, "vocab_size": vocab_size, "kept": kept.tolist(), "coverage": cov,
            "response_tokens": total, "heldout_response_tokens": htotal,
            "distinct_tokens": int((counts > 0).sum()),
            "shards": [p.name for p in list_shards(data_dir)]}
    out = Path(out) if out else data_dir / f"vocab_{size}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, out)
    return info


def load_vocab(path) -> torch.Tensor:
    return torch.tensor(json.loads(Path(path).read_text())["kept"], dtype=torch.long)


# ----------------------------------------------------------------------------- data

VAL_PERCENT = 3


def is_val(prompt_id: str, percent: int = VAL_PERCENT) -> bool:
    """Held-out split by a fixed hash of the prompt id (never trained on)."""
    h = int.from_bytes(hashlib.sha256(("val:" + prompt_id).encode()).digest()[:4], "big")
    return h % 100 < percent


@dataclass
class Batch:
    input_ids: torch.Tensor        # [B, S]
    features: torch.Tensor | None  # [B, S, 3H] float32 (row p, zero padding); None: recompute
    final_hidden: torch.Tensor | None  # [B, S, H] float32; None with features
    target_argmax: torch.Tensor    # [B, S] int64 (-1 = unknown / padding)
    attention_mask: torch.Tensor   # [B, S] long
    lengths: torch.Tensor          # [B] tokens per sequence
    prompt_lens: torch.Tensor      # [B]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> "Batch":
        """The batch on ``device`` (collate and the taps work on the CPU; the loss runs where the
        draft is)."""
        from dataclasses import fields, replace

        return replace(self, **{f.name: (None if getattr(self, f.name) is None else
                                         getattr(self, f.name).to(device, non_blocking=True))
                                for f in fields(self)})


def collate(seqs: list[Sequence_], max_len: int | None = None) -> Batch:
    """Right-padded batch. Rows past ``len - 1`` (no feature) are zero. Sequences longer than
    ``max_len`` are cut to their first ``max_len`` tokens. If any sequence comes from a
    token-only shard, the batch has no taps (``features is None``): ``with_taps`` fills them."""
    lens = [min(s.tokens.numel(), max_len or 1 << 30) for s in seqs]
    B, S = len(seqs), max(lens)
    stored = all(s.features is not None for s in seqs)
    ids = torch.zeros(B, S, dtype=torch.long)
    feats = torch.zeros(B, S, seqs[0].features.shape[-1]) if stored else None
    fin = torch.zeros(B, S, seqs[0].final_hidden.shape[-1]) if stored else None
    am = torch.full((B, S), -1, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, (s, n) in enumerate(zip(seqs, lens)):
        ids[b, :n] = s.tokens[:n]
        r = n - 1
        if stored:
            r = min(n, s.features.shape[0])
            feats[b, :r] = s.features[:r].float()
            fin[b, :r] = s.final_hidden[:r].float()
        if s.target_argmax is not None:
            am[b, :r] = s.target_argmax[:r]
        else:  # greedy sequences: the next token is the target's argmax
            am[b, :r] = s.tokens[1:r + 1]
        mask[b, :n] = 1
    return Batch(ids, feats, fin, am, mask, torch.tensor(lens),
                 torch.tensor([s.prompt_len for s in seqs]))


def with_taps(batch: Batch, tap_model) -> Batch:
    """``batch`` itself when its taps were stored, else a copy with the taps recomputed by
    ``tap_model`` (the target; ``distill.recompute_taps``), left on the tap model's device (the
    trainer's: ``Batch.to`` then moves only the small tensors). Row ``len - 1`` of every
    sequence, which no stored shard has, is zeroed as ``collate`` pads it."""
    if batch.features is not None:
        return batch
    from dataclasses import replace

    from .distill import recompute_taps

    feats, final = recompute_taps(tap_model, batch.input_ids, batch.attention_mask, on_model_device=True)
    lengths = batch.lengths.to(feats.device)
    last = torch.arange(batch.input_ids.shape[1], device=feats.device)[None] >= (lengths - 1)[:, None]
    feats.masked_fill_(last.unsqueeze(-1), 0.0)
    final.masked_fill_(last.unsqueeze(-1), 0.0)
    return replace(batch, features=feats, final_hidden=final)


def sequences_with_taps(seqs: list[Sequence_], tap_model) -> list[Sequence_]:
    """Sequences of token-only shards with their taps recomputed (one forward each); others
    unchanged."""
    from dataclasses import replace

    from .distill import recompute_taps

    out = []
    for s in seqs:
        if s.features is None:
            f, h = recompute_taps(tap_model, s.tokens[None, :-1].long())
            s = replace(s, features=f[0], final_hidden=h[0])
        out.append(s)
    return out


class DataStream:
    """Deterministic, resumable stream of training batches over a (possibly growing) shard dir."""

    def __init__(self, data_dir, batch_tokens: int = 2048, max_len: int = 768,
                 group_shards: int = 4, seed: int = 0, min_shards: int = 1):
        self.data_dir = Path(data_dir)
        self.batch_tokens = batch_tokens
        self.max_len = max_len
        self.group_shards = group_shards
        self.seed = seed
        self.min_shards = min_shards
        self.state = {"epoch": 0, "seen": [], "group": [], "group_id": 0, "batch": 0}
        self._cache_key = None
        self._batches: list[list[Sequence_]] = []

    def state_dict(self) -> dict:
        return json.loads(json.dumps(self.state))

    def load_state_dict(self, st: dict) -> None:
        self.state = json.loads(json.dumps(st))
        self._cache_key = None

    def _plan_group(self, names: list[str], gid: int) -> list[list[Sequence_]]:
        seqs = []
        for name in names:
            sh = DistillShard(self.data_dir / name)
            seqs.extend(s for s in sh if not is_val(s.prompt_id) and s.tokens.numel() >= 4)
        rng = random.Random(f"{self.seed}-group-{gid}")
        rng.shuffle(seqs)
        seqs.sort(key=lambda s: min(s.tokens.numel(), self.max_len))
        batches, cur, cur_max = [], [], 0
        for s in seqs:
            n = min(s.tokens.numel(), self.max_len)
            if cur and max(cur_max, n) * (len(cur) + 1) > self.batch_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(s)
            cur_max = max(cur_max, n)
        if cur:
            batches.append(cur)
        rng.shuffle(batches)
        return batches

    def _next_group(self) -> None:
        st = self.state
        while True:
            avail = [p.name for p in list_shards(self.data_dir)]
            if len(avail) < self.min_shards:
                raise RuntimeError(f"{self.data_dir}: {len(avail)} shards, need {self.min_shards}")
            fresh = sorted(set(avail) - set(st["seen"]))
            if fresh:
                break
            st["epoch"] += 1
            st["seen"] = []
        rng = random.Random(f"{self.seed}-pick-{st['epoch']}-{st['group_id']}")
        # prefer shards never used in any epoch so far (new data first), then random
        pick = rng.sample(fresh, min(self.group_shards, len(fresh)))
        st["group"] = sorted(pick)
        st["seen"] = sorted(set(st["seen"]) | set(pick))
        st["group_id"] += 1
        st["batch"] = 0

    def next_batch(self) -> Batch:
        st = self.state
        while True:
            if not st["group"]:
                self._next_group()
            key = (tuple(st["group"]), st["group_id"])
            if key != self._cache_key:
                self._batches = self._plan_group(st["group"], st["group_id"])
                self._cache_key = key
            if st["batch"] < len(self._batches):
                b = self._batches[st["batch"]]
                st["batch"] += 1
                return collate(b, self.max_len)
            st["group"] = []


def validation_sequences(data_dir, max_seqs: int = 96, greedy_only: bool = False) -> list[tuple[str, int]]:
    """(shard name, index) of held-out sequences, in shard order (fixed once chosen)."""
    out = []
    for path in list_shards(data_dir):
        sh = DistillShard(path)
        for i in range(len(sh)):
            if is_val(sh.prompt_ids[i]) and (not greedy_only or not bool(sh.sampled[i])):
                out.append((path.name, i))
    return out[:max_seqs]


def load_sequences(data_dir, refs: list[tuple[str, int]]) -> list[Sequence_]:
    cache, out = {}, []
    for name, i in refs:
        if name not in cache:
            cache[name] = DistillShard(Path(data_dir) / name)
        out.append(cache[name].sequence(i))
    return out


# ----------------------------------------------------------------------------- model helpers


def load_target_for_training(target_dir=None):
    """(HF LlamaForCausalLM fp32, tokenizer or None) for the given dir or the built-in target."""
    from transformers import LlamaForCausalLM

    if target_dir is None:
        from ..defaults import default_target_dir

        target_dir = default_target_dir()
    model = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _target_head(target) -> torch.Tensor:
    """The target's output projection [V, H] (tied to the embedding for SmolLM2)."""
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    w = head.weight if head is not None else target.lm_head.weight
    return w.detach().float()


def _target_final_norm(target) -> torch.Tensor | None:
    inner = getattr(target, "model", None)
    norm = getattr(inner, "norm", None) if inner is not None else getattr(target, "norm", None)
    return None if norm is None else norm.weight.detach().float()


def new_draft(target, kept: torch.Tensor, seed: int = 0, init_from_target: bool = True,
              intermediate_size: int | None = None):
    """A fresh draft for ``target`` over the draft vocabulary ``kept`` (fp32, for training);
    ``intermediate_size``: its MLP width (default: the target's).

    With ``init_from_target`` (the default; chosen by a small A/B on the distilled data, where it
    reached the lowest KL after a few dozen steps):
      * ``lm_head`` = the target's output rows of the draft vocabulary (the trainer freezes it by
        default, as EAGLE-1/2 do with the full head; it is still exported as the EAGLE-3 head);
      * ``norm.weight`` = 0.1 x the target's final-norm weight, so the first predictions are
        near-uniform instead of confidently random (random draft hidden states dotted with the
        target's head give logits with a std of ~6 and a KL of ~30 nats);
      * ``fc`` = identity on the high tap (the hidden state entering layer L-3, the closest to
        the target's output space) plus the random init scaled by 0.1 on the low and mid taps.
    """
    from ..models.draft import Eagle3Draft

    draft = Eagle3Draft.for_target(target, draft_vocab_size=int(kept.numel()), seed=seed,
                                   kept_ids=kept, dtype=torch.float32, intermediate_size=intermediate_size)
    if init_from_target:
        with torch.no_grad():
            # the target may already be on the training device (CUDA), the new draft is not yet
            head = _target_head(target)
            ids = draft.to_target_ids(torch.arange(kept.numel(), device=draft.d2t.device))
            draft.lm_head.weight.copy_(head[ids.to(head.device)])
            nw = _target_final_norm(target)
            if nw is not None and nw.shape == draft.norm.weight.shape:
                draft.norm.weight.copy_(0.1 * nw)
            H, Ht = draft.config.hidden_size, draft.config.target_hidden_size
            if draft.fc is not None and H == Ht:
                draft.fc.weight[:, :2 * Ht].mul_(0.1)
                draft.fc.weight[:, 2 * Ht:].copy_(torch.eye(H))
    return draft


MLP_GATE = "midlayer.mlp.gate_proj.weight"      # [intermediate, H]: a draft state's MLP width


def mlp_width(state: dict) -> int:
    """The MLP width (``intermediate_size``) of a draft state dict."""
    return int(state[MLP_GATE].shape[0])


def source_mlp_width(src) -> int:
    """The MLP width of an earlier draft: an exported draft directory (its config.json) or a
    training checkpoint (read memory-mapped, so nothing but the one shape is loaded)."""
    src = os.fspath(src)
    if os.path.isdir(src):
        cfg = json.loads((Path(src) / "config.json").read_text())
        return int(cfg["intermediate_size"])
    if os.path.isfile(src):
        return mlp_width(torch.load(src, map_location="cpu", weights_only=False, mmap=True)["draft"])
    raise FileNotFoundError(f"warm start: no draft directory or checkpoint at {src}")


def widen_mlp_(dst: dict, src: dict, prefix: str = "midlayer.mlp.") -> None:
    """Copy an MLP of width n into one of width N >= n, in place, so that it computes the same
    function: gate/up rows [:n] and down columns [:n] are the source's, the new down columns are
    zero (the new units add nothing until training moves them; their gate/up rows keep their
    random init, so the units are not dead). ``dst``/``src``: tensors by name (state dicts);
    names are ``prefix`` + gate_proj / up_proj / down_proj + .weight / .bias."""
    n = int(src[prefix + "gate_proj.weight"].shape[0])
    N = int(dst[prefix + "gate_proj.weight"].shape[0])
    if N < n:
        raise ValueError(f"the draft's MLP ({N} wide) is narrower than the one it starts from ({n}): "
                         f"give an intermediate size of at least {n}")
    with torch.no_grad():
        for name in ("gate_proj", "up_proj"):
            dst[prefix + name + ".weight"][:n].copy_(src[prefix + name + ".weight"])
            if prefix + name + ".bias" in src and prefix + name + ".bias" in dst:
                dst[prefix + name + ".bias"][:n].copy_(src[prefix + name + ".bias"])
        down = dst[prefix + "down_proj.weight"]
        down[:, :n].copy_(src[prefix + "down_proj.weight"])
        down[:, n:].zero_()
        if prefix + "down_proj.bias" in src and prefix + "down_proj.bias" in dst:
            dst[prefix + "down_proj.bias"].copy_(src[prefix + "down_proj.bias"])


def init_layer_from_target(draft, target, layer: int) -> int:
    """Initialise the draft's decoder layer from target decoder layer ``layer`` (negative counts
    from the end, e.g. -3: the layer whose input is the draft's high tap); returns its index.

    The draft layer reads ``cat(input_layernorm(embed), hidden_norm(g))`` [.., 2H] where a target
    layer reads its residual stream [.., H]. The target's Q/K/V columns go to the ``g`` half and
    the embedding half keeps 0.1 x its random init, so at step 0 the draft layer acts on ``g``
    much as the target layer acts on the stream (``g`` starts as the high tap, see
    ``new_draft``); ``hidden_norm`` and ``post_attention_layernorm`` take the target layer's
    norms; o_proj and the MLP are copied (into the first units of a wider MLP, see
    ``widen_mlp_``)."""
    inner = getattr(target, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"init_layer needs a transformers Llama target with model.layers, "
                        f"got {type(target).__name__}")
    L = len(layers)
    if not -L <= layer < L:
        raise ValueError(f"init_layer {layer} is outside the target's {L} layers "
                         f"(use 0..{L - 1} or -{L}..-1)")
    idx = layer % L
    src, dst = layers[idx], draft.midlayer
    H = draft.config.hidden_size
    # (target module, draft module, True where the draft reads [embed; g] and the target reads H)
    pairs = [(getattr(src.self_attn, n), getattr(dst.self_attn, n), n != "o_proj")
             for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    for a, b, split in pairs:
        want = (b.weight.shape[0], H) if split else tuple(b.weight.shape)
        if tuple(a.weight.shape) != want:
            raise ValueError(f"init_layer: target layer {idx}'s weight {tuple(a.weight.shape)} does "
                             f"not fit the draft's {want} (a draft of another width or head layout)")
    with torch.no_grad():
        for a, b, split in pairs:
            if split:
                b.weight[:, :H].mul_(0.1)
                b.weight[:, H:].copy_(a.weight)
            else:
                b.weight.copy_(a.weight)
            if a.bias is not None and b.bias is not None:
                b.bias.copy_(a.bias)
        widen_mlp_(dict(dst.mlp.named_parameters()), dict(src.mlp.named_parameters()), prefix="")
        dst.hidden_norm.weight.copy_(src.input_layernorm.weight)
        dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
    return idx


def warm_start(draft, src, target) -> dict | None:
    """Copy every vocabulary-independent weight of an earlier draft ``src`` (an exported draft
    directory or a training checkpoint) into ``draft``, in place. The draft vocabulary may
    differ: ``lm_head`` stays the target's rows of ``draft``'s own vocabulary, which is exactly
    what a frozen-head draft's head is, so nothing learnt is lost. A head that was trained
    (``--train-lm-head``: it differs from the target's rows by more than fp16 rounding) is copied
    too when the two vocabularies are the same. Returns the loaded checkpoint when ``src`` is one
    (``warm_start_info`` reads its history from it instead of loading it again), else None."""
    src, ckpt = os.fspath(src), None
    if os.path.isdir(src):
        from ..models.draft import Eagle3Draft

        sd = Eagle3Draft.from_pretrained(src, target=target, dtype=torch.float32).state_dict()
    elif os.path.isfile(src):
        ckpt = torch.load(src, map_location="cpu", weights_only=False)
        sd = ckpt["draft"]
    else:
        raise FileNotFoundError(f"warm start: no draft directory or checkpoint at {src}")
    own = draft.state_dict()
    skip = {"lm_head.weight", "d2t", "t2d"}
    widen = mlp_width(own) != mlp_width(sd)
    mlp = {k for k in sd if k.startswith("midlayer.mlp.")}
    if widen:
        skip |= mlp                   # copied below into the first units of a wider MLP
    bad = [k for k, v in sd.items() if k not in skip and (k not in own or own[k].shape != v.shape)]
    if bad:
        raise ValueError(f"warm start: {src} does not fit this draft (keys or shapes differ: {bad[:4]})")
    with torch.no_grad():
        for k, v in sd.items():
            if k not in skip:
                own[k].copy_(v.float())
        if widen:
            widen_mlp_(own, {k: sd[k].float() for k in mlp})
        head = sd.get("lm_head.weight")
        same_vocab = "d2t" in sd and torch.equal(sd["d2t"].to(own["d2t"]), own["d2t"])   # (shapes too)
        if (head is not None and same_vocab
                and not torch.allclose(head.float(), own["lm_head.weight"], rtol=2e-3, atol=2e-3)):
            own["lm_head.weight"].copy_(head.float())
    return ckpt


# ----------------------------------------------------------------------------- loss


def ttt_loss(draft, batch: Batch, head_kept: torch.Tensor, ttt_steps: int,
             decay: float = 0.8, with_metrics: bool = True):
    """Training-time-test loss. Returns (loss, metrics dict with per-step soft CE, KL, top-1
    agreement (within the draft vocab and against the full-vocabulary greedy token) and counts).
    ``head_kept`` [Vd, H]: the target's lm_head rows of the draft vocabulary.

    Step s, row p predicts token p + 2 + s; its target distribution is softmax over the draft
    vocabulary of ``final_hidden[p + 1 + s] @ head_kept.T``. Only response tokens (index >=
    prompt_len) whose target greedy token lies in the draft vocabulary are scored."""
    B, S = batch.input_ids.shape
    out = draft.forward_train(batch.input_ids, batch.features, batch.attention_mask,
                              ttt_steps=ttt_steps, return_logits=False)
    t2d = draft.t2d
    dev = batch.input_ids.device
    pos = torch.arange(S, device=dev)
    # teacher distributions, once per batch, for every row that some step scores
    row_ok = ((pos[None] + 1 < batch.lengths[:, None]) & (pos[None] + 1 >= batch.prompt_lens[:, None])
              & (batch.target_argmax >= 0) & t2d[batch.target_argmax.clamp(min=0)])
    rb, rp = row_ok.nonzero(as_tuple=True)
    row_index = torch.full((B, S), -1, dtype=torch.long, device=dev)
    row_index[rb, rp] = torch.arange(rb.numel(), device=dev)
    with torch.no_grad():
        t_logits = batch.final_hidden[rb, rp] @ head_kept.T            # [R, Vd]
        t_logp = torch.log_softmax(t_logits, dim=-1)
        t_p = t_logp.exp()
        t_top = t_logits.argmax(-1)
        t_ent = -(t_p * t_logp).sum(-1)
    total = batch.features.new_zeros(())
    metrics = {"loss": [], "kl": [], "acc": [], "acc_full": [], "n": []}
    for s, h in enumerate(out.hidden):
        tgt_row = pos + 1 + s                       # final_hidden row giving the target dist
        valid = (tgt_row[None] + 1 < batch.lengths[:, None]) & (tgt_row[None] + 1 >= batch.prompt_lens[:, None])
        rows = tgt_row.clamp(max=S - 1)
        known = valid & (batch.target_argmax[:, rows] >= 0)
        ri = torch.where(valid, row_index[:, rows], -1)
        sel = ri >= 0
        n_known = int(known.sum())
        if int(sel.sum()) == 0:
            for k in ("loss", "kl", "acc", "acc_full"):
                metrics[k].append(float("nan"))
            metrics["n"].append(0)
            continue
        bi, pi = sel.nonzero(as_tuple=True)
        r = ri[bi, pi]
        logq = torch.log_softmax(draft.logits(h[bi, pi]), dim=-1)         # [N, Vd]
        ce = -(t_p[r] * logq).sum(-1)
        loss_s = ce.mean()
        total = total + (decay ** s) * loss_s
        if with_metrics:
            with torch.no_grad():
                agree = (logq.argmax(-1) == t_top[r]).float()
                metrics["loss"].append(float(loss_s.detach()))
                metrics["kl"].append(float((ce.detach() - t_ent[r]).mean()))
                metrics["acc"].append(float(agree.mean()))
                # agreement with the full-vocabulary greedy token (out-of-vocab rows = misses)
                metrics["acc_full"].append(float(agree.sum()) / max(1, n_known))
                metrics["n"].append(int(sel.sum()))
    return total, metrics


# ----------------------------------------------------------------------------- config / trainer


@dataclass
class TrainConfig:
    data_dir: str
    run_dir: str
    vocab_size: int = 8192
    steps: int = 3000
    batch_tokens: int = 2048
    max_len: int = 768
    # training-time-test unroll: default = the deepest draft the engine runs (12 candidate
    # layers: OFFICIAL depth 7 + DED alpha 4 + 1; heterospec.train.deepest_draft_layers). It can
    # change between resumes (the weights do not depend on it), e.g. a 3-step run continued at 12.
    ttt_steps: int = field(default_factory=default_ttt_steps)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    decay: float = 0.8
    val_seqs: int = 96
    eval_every: int = 250
    eval_ttt_steps: int = 6
    ckpt_every: int = 50
    sim_every: int = 0               # steps between tau simulations during training (0 = at eval)
    sim_seqs: int = 6
    time_budget_s: float | None = None
    # an absolute end (epoch seconds) for starting steps, whatever the schedule: the last
    # checkpoint, evaluation and export still need their time before a lease or job ends
    stop_at: float | None = None
    seed: int = 0
    threads: int = 1
    group_shards: int = 4
    target_dir: str | None = None
    # keep lm_head = the target's output rows (saves ~1/4 compute); --train-lm-head trains it,
    # as EAGLE-3 does with its own draft-vocabulary head
    freeze_lm_head: bool = True
    init_from: str | None = None     # warm start (new runs only): an exported draft dir or a ckpt
    init_layer: int | None = None    # new runs only: the target layer the draft's layer starts as
    # the draft MLP's width: None = the warm start's (--init), else the target's; a resumed run
    # keeps its own. Wider than the warm start's: widened so that it starts as the same function
    intermediate_size: int | None = None
    # precision of the target forward that recomputes the taps of token-only shards: auto =
    # bfloat16 where the CPU has native bf16 (or on CUDA), else float32 (distill's rule)
    taps_dtype: str = "auto"
    # mixed precision of the draft's forward and backward (weights and AdamW stay float32):
    # auto = bfloat16 autocast where the CPU has native bf16 (or on CUDA), else float32
    amp: str = "auto"
    # where the draft trains: "cpu", "cuda", "cuda:N" or "auto" (CUDA when available). The
    # target's taps are recomputed there too; batches are built on the CPU.
    device: str = "cpu"


def lr_at(cfg: TrainConfig, step: int, train_seconds: float = 0.0) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio``; the decay follows whichever is
    further along: the step count or the training time against ``time_budget_s``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    if cfg.time_budget_s:
        t = max(t, min(1.0, train_seconds / cfg.time_budget_s))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Trainer:
    def __init__(self, cfg: TrainConfig, target=None, log=print):
        self.cfg = cfg
        self.log = log
        torch.set_num_threads(max(1, cfg.threads))
        self.run = Path(cfg.run_dir)
        self.run.mkdir(parents=True, exist_ok=True)
        from .distill import resolve_device_dtype

        self.device, _ = resolve_device_dtype(cfg.device, "float32")
        self.target = target if target is not None else load_target_for_training(cfg.target_dir)
        self.target.to(self.device)
        vocab_file = Path(cfg.data_dir) / f"vocab_{cfg.vocab_size}.json"
        run_vocab = self.run / "vocab.json"
        if run_vocab.exists():  # a resumed run keeps its own vocabulary
            kept = load_vocab(run_vocab)
        else:
            if not vocab_file.exists():
                info = build_vocab(cfg.data_dir, cfg.vocab_size,
                                   vocab_size=self.target.config.vocab_size)
                log(f"built draft vocab {cfg.vocab_size}: coverage {info['coverage']}")
            run_vocab.write_text(vocab_file.read_text())
            kept = load_vocab(run_vocab)
        torch.manual_seed(cfg.seed)
        ck = self.run / "ckpt_latest.pt"
        self.draft = new_draft(self.target, kept, seed=cfg.seed, intermediate_size=self._mlp_width(ck))
        if cfg.init_from and cfg.init_layer is not None:
            raise ValueError("--init-layer initialises a new draft and --init warm-starts one from "
                             "an earlier draft: give one of them")
        self.warm_start_from: dict | None = None   # what a warm-started run started from (training_info)
        if cfg.init_from and not ck.exists():
            ckpt = warm_start(self.draft, cfg.init_from, self.target)
            self.warm_start_from = warm_start_info(cfg.init_from, ckpt=ckpt)
            log(f"warm start from {cfg.init_from}")
        elif cfg.init_layer is not None and not ck.exists():
            idx = init_layer_from_target(self.draft, self.target, cfg.init_layer)
            log(f"draft layer initialised from target layer {idx}")
        self.cfg.intermediate_size = self.draft.config.intermediate_size    # (train_config.json)
        self.draft.to(self.device)
        self.draft.train()
        if cfg.freeze_lm_head:
            self.draft.lm_head.weight.requires_grad_(False)
        self.head_kept = _target_head(self.target)[self.draft.to_target_ids(
            torch.arange(kept.numel(), device=self.device))].contiguous()
        params = [p for p in self.draft.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(0.9, 0.95))
        self.stream = DataStream(cfg.data_dir, cfg.batch_tokens, cfg.max_len,
                                 group_shards=cfg.group_shards, seed=cfg.seed)
        self.step = 0
        self.resumed_from_stop = False   # set by SIGCONT (see train_step)
        self.typical_step_s = 0.0
        self.tokens_seen = 0
        self.train_seconds = 0.0          # cumulative over resumes (drives the time schedule)
        self.history: list[dict] = []
        self.ttt_history: list[list[int]] = []   # [first step, ttt_steps] per change
        self.machines: list[list] = []           # [first step, training_machine()] per change
        self.val_refs = None
        self._tap_model = None
        if ck.exists():
            self.load_checkpoint(ck)
            log(f"resumed from {ck} at step {self.step}")
        if not self.ttt_history or self.ttt_history[-1][1] != cfg.ttt_steps:
            self.ttt_history.append([self.step, cfg.ttt_steps])
        here = training_machine(self.device, cfg.threads)
        if not self.machines or self.machines[-1][1] != here:    # a run resumed elsewhere
            self.machines.append([self.step, here])
        if self.val_refs is None:
            self.val_refs = validation_sequences(cfg.data_dir, cfg.val_seqs)
        (self.run / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1))

    def _mlp_width(self, ck: Path) -> int | None:
        """The draft's MLP width: a resumed run's own (an explicit other width is an error, as
        the checkpoint would not load), else --intermediate-size, else the warm start's."""
        want = self.cfg.intermediate_size
        if ck.exists():
            have = mlp_width(torch.load(ck, map_location="cpu", weights_only=False, mmap=True)["draft"])
            if want is not None and want != have:
                raise ValueError(f"{ck} is a draft with an MLP {have} wide; resume it without "
                                 f"--intermediate-size {want} (or with {have}), or start a new run")
            self.cfg.intermediate_size = have
            return have
        if want is None and self.cfg.init_from:
            want = source_mlp_width(self.cfg.init_from)
        return want

    # ---- checkpoints ----

    def state(self) -> dict:
        return {"draft": self.draft.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                "tokens_seen": self.tokens_seen, "train_seconds": self.train_seconds, "stream": self.stream.state_dict(),
                "history": self.history, "val_refs": self.val_refs, "config": asdict(self.cfg),
                "ttt_history": self.ttt_history, "machines": self.machines,
                "warm_start": self.warm_start_from, "rng": torch.get_rng_state()}

    def save_checkpoint(self, name: str = "ckpt_latest.pt") -> Path:
        path = self.run / name
        _atomic_save(self.state(), path)
        return path

    def load_checkpoint(self, path) -> None:
        st = torch.load(path, map_location="cpu", weights_only=False)
        frozen = (st.get("config") or {}).get("freeze_lm_head", True)
        if frozen != self.cfg.freeze_lm_head:
            # the optimizer's parameter groups differ; resuming would fail deep inside AdamW
            raise ValueError(f"{path} was trained with its lm_head {'frozen' if frozen else 'trained'}; "
                             f"resume it {'without' if frozen else 'with'} --train-lm-head, or start a new run")
        self.draft.load_state_dict(st["draft"])
        self.opt.load_state_dict(st["opt"])
        old_ttt = (st.get("config") or {}).get("ttt_steps")
        if old_ttt is not None and old_ttt != self.cfg.ttt_steps:
            self.log(f"{path}: trained with ttt_steps={old_ttt} until step {st['step']}; "
                     f"continuing with ttt_steps={self.cfg.ttt_steps}")
        self.ttt_history = list(st.get("ttt_history") or
                                ([[0, old_ttt]] if old_ttt is not None else []))
        self.step = st["step"]
        self.tokens_seen = st.get("tokens_seen", 0)
        self.train_seconds = st.get("train_seconds", 0.0)
        self.stream.load_state_dict(st["stream"])
        self.history = st.get("history", [])
        self.machines = list(st.get("machines") or [])
        self.warm_start_from = st.get("warm_start")
        self.val_refs = [tuple(r) for r in st["val_refs"]] if st.get("val_refs") else None
        torch.set_rng_state(st["rng"])

    # ---- train / eval ----

    def tap_model(self):
        """The target that recomputes taps of token-only shards, in ``cfg.taps_dtype``."""
        if self._tap_model is None:
            from .distill import resolve_device_dtype

            _, dt = resolve_device_dtype(str(self.device), self.cfg.taps_dtype)
            if dt == torch.float32:
                self._tap_model = self.target
            else:
                import copy

                self._tap_model = copy.deepcopy(self.target).to(dt)
        return self._tap_model

    def autocast(self):
        """``torch.autocast`` in ``cfg.amp`` (bfloat16 roughly halves a step on a CPU with
        native bf16), or a no-op context for float32."""
        import contextlib

        from .distill import resolve_device_dtype

        _, dt = resolve_device_dtype(str(self.device), self.cfg.amp)
        if dt == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dt)

    def train_step(self, batch: Batch) -> dict:
        from ..timing import timestamp

        cfg = self.cfg
        t0 = time.time()
        # phase times (device-synchronised on CUDA): where a step goes, in the log of every step
        p0 = timestamp(self.device)
        batch = with_taps(batch, self.tap_model()).to(self.device)  # counted: recomputing is part of the step
        p1 = timestamp(self.device)
        lr = lr_at(cfg, self.step, self.train_seconds)
        for g in self.opt.param_groups:
            g["lr"] = lr
        with self.autocast():
            loss, m = ttt_loss(self.draft, batch, self.head_kept, cfg.ttt_steps, cfg.decay)
        p2 = timestamp(self.device)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_([p for p in self.draft.parameters() if p.requires_grad],
                                            cfg.grad_clip)
        self.opt.step()
        m["phase_s"] = {"taps": p1 - p0, "forward_loss": p2 - p1, "backward_step": timestamp(self.device) - p2}
        self.step += 1
        self.tokens_seen += batch.num_tokens
        dt = time.time() - t0
        if self.resumed_from_stop:
            # the process was stopped (SIGSTOP) and continued during this step: count a typical
            # step, so pausing a run (e.g. for a benchmark) does not spend its time budget
            self.resumed_from_stop = False
            dt = min(dt, self.typical_step_s) if self.typical_step_s else dt
        else:
            self.typical_step_s = dt if not self.typical_step_s else 0.9 * self.typical_step_s + 0.1 * dt
        self.train_seconds += dt
        m["lr"] = lr
        m["total"] = float(loss.detach())
        m["grad_norm"] = float(gn)
        return m

    @torch.no_grad()
    def evaluate(self, ttt_steps: int | None = None) -> dict:
        cfg = self.cfg
        steps = ttt_steps or max(cfg.ttt_steps, cfg.eval_ttt_steps)
        seqs = load_sequences(cfg.data_dir, self.val_refs)
        self.draft.eval()
        agg = {"loss": [0.0] * steps, "kl": [0.0] * steps, "acc": [0.0] * steps,
               "acc_full": [0.0] * steps, "n": [0] * steps}
        seqs = sorted(seqs, key=lambda s: s.tokens.numel())
        i = 0
        while i < len(seqs):
            chunk = [seqs[i]]
            i += 1
            while i < len(seqs) and seqs[i].tokens.numel() * (len(chunk) + 1) <= 2 * cfg.batch_tokens:
                chunk.append(seqs[i])
                i += 1
            batch = with_taps(collate(chunk, cfg.max_len), self.tap_model()).to(self.device)
            with self.autocast():
                _, m = ttt_loss(self.draft, batch, self.head_kept, steps, cfg.decay)
            for s in range(steps):
                n = m["n"][s]
                if n:
                    agg["loss"][s] += m["loss"][s] * n
                    agg["kl"][s] += m["kl"][s] * n
                    agg["acc"][s] += m["acc"][s] * n
                    agg["acc_full"][s] += m["acc_full"][s] * n
                    agg["n"][s] += n
        self.draft.train()
        res = {k: [v / max(1, n) for v, n in zip(agg[k], agg["n"])] for k in ("loss", "kl", "acc", "acc_full")}
        res["n"] = agg["n"]
        return res

    def simulate(self, seqs: int | None = None, **kw) -> dict:
        refs = [r for r in self.val_refs]
        data = [s for s in load_sequences(self.cfg.data_dir, refs) if not s.sampled]
        data = sequences_with_taps(data[: seqs or self.cfg.sim_seqs], self.tap_model())
        self.draft.eval()
        try:
            return simulate_acceptance(self.draft, data, **kw)
        finally:
            self.draft.train()

    def fit(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        t0 = time.time()
        tok0 = self.tokens_seen
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train-draft", dynamic_ncols=True,
                   mininterval=10)
        ema = None
        logf = (self.run / "train_log.jsonl").open("a")
        stop = {"sig": None}
        old_handlers = {}

        def _graceful(signum, frame):  # SIGTERM / SIGINT: finish the step, checkpoint, exit
            stop["sig"] = signum

        def _continued(signum, frame):  # SIGCONT after a SIGSTOP: the step's wall time is not its own
            self.resumed_from_stop = True

        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                old_handlers[sig] = signal.signal(sig, _graceful)
            old_handlers[signal.SIGCONT] = signal.signal(signal.SIGCONT, _continued)
        try:
            while self.step < cfg.steps:
                if stop["sig"] is not None:
                    self.log(f"signal {stop['sig']}: checkpointing at step {self.step} and stopping")
                    self.save_checkpoint()
                    return {"stopped": True, "step": self.step}
                if cfg.time_budget_s is not None and self.train_seconds > cfg.time_budget_s:
                    self.log(f"time budget reached at step {self.step}")
                    break
                if cfg.stop_at is not None and time.time() >= cfg.stop_at:
                    self.log(f"stop time reached at step {self.step}")
                    break
                d0 = time.perf_counter()
                batch = self.stream.next_batch()
                data_s = time.perf_counter() - d0
                m = self.train_step(batch)
                ema = m["acc"] if ema is None else [0.95 * a + 0.05 * b if not math.isnan(b) else a
                                                    for a, b in zip(ema, m["acc"])]
                el = time.time() - t0
                tps = (self.tokens_seen - tok0) / max(el, 1e-9)
                bar.update(1)
                bar.set_postfix(loss=f"{m['total']:.3f}", acc="/".join(f"{a:.2f}" for a in ema),
                                tok_s=f"{tps:.0f}")
                rec = {"step": self.step, "loss": m["total"], "step_loss": m["loss"], "kl": m["kl"],
                       "acc": m["acc"], "acc_full": m["acc_full"], "lr": m["lr"],
                       "grad_norm": m["grad_norm"], "tokens": self.tokens_seen,
                       "tok_s": tps, "epoch": self.stream.state["epoch"], "time": time.time(),
                       "phase_s": {"data": data_s, **m["phase_s"]}}
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
                if self.step % cfg.ckpt_every == 0:
                    self.save_checkpoint()
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    self._eval_and_log(logf)
            self.save_checkpoint()
            final = self._eval_and_log(logf)
        finally:
            bar.close()
            logf.close()
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
        return final

    def _eval_and_log(self, logf) -> dict:
        te = time.time()
        ev = self.evaluate()
        ev["step"] = self.step
        ev["eval_s"] = time.time() - te
        try:
            sim = self.simulate(top_k=6, depth=6, nodes=24)
            chain = self.simulate(top_k=1, depth=6, nodes=6)
            ev["tau_tree"] = sim["tau"]
            ev["tau_chain"] = chain["tau"]
        except Exception as exc:  # the simulation is a diagnostic; never kill training for it
            ev["sim_error"] = repr(exc)
        self.history.append(ev)
        logf.write(json.dumps({"eval": ev}) + "\n")
        logf.flush()
        best = min((h["loss"][0] for h in self.history if "loss" in h), default=None)
        if best is not None and ev["loss"][0] <= best:
            self.save_checkpoint("ckpt_best.pt")
        self.log(f"eval @ {self.step}: val kl {['%.3f' % x for x in ev['kl']]} "
                 f"acc {['%.3f' % x for x in ev['acc']]} acc_full {['%.3f' % x for x in ev['acc_full']]} "
                 f"tau_tree {ev.get('tau_tree', float('nan')):.3f} tau_chain "
                 f"{ev.get('tau_chain', float('nan')):.3f} ({time.time() - te:.0f}s)")
        return ev


# ----------------------------------------------------------------------------- acceptance simulation


@torch.no_grad()
def simulate_acceptance(draft, seqs: list[Sequence_], top_k: int = 6, depth: int = 6,
                        nodes: int = 24, max_rounds: int | None = None) -> dict:
    """Mean acceptance length tau (accepted drafts + 1 per target forward) on greedy sequences.

    For each sequence, decoding starts with the first response token as the root (the target's
    prefill output). Each round: the draft ``extend``s over the newly committed entries (target
    features of the recorded run), builds an EAGLE-2 tree (``depth`` layers, ``top_k`` frontier,
    ``top_k**2`` candidates per layer, global rerank to ``nodes`` draft tokens, closed under
    ancestors), and the greedy target accepts the longest path matching the recorded tokens
    (which are the target's greedy choices). ``top_k=1, nodes=depth`` simulates a chain."""
    dev = draft.device
    total_acc = total_rounds = 0
    hist = [0] * (depth + 1)
    for seq in seqs:
        toks = seq.tokens.long()
        n = toks.numel()
        P = seq.prompt_len
        if n - P < 2:
            continue
        feats = seq.features.float()
        cache = draft.new_cache(1, n + 1)
        L = 0          # draft cache length = committed target length
        root = P       # index of the root token (target-sampled, not yet committed)
        h_root = None
        rounds = 0
        while root < n - 1:
            # commit entries L..root-1: feature(p) with token(p+1)
            num = root - L
            ids = toks[L + 1: root + 1][None]
            out = draft.extend(ids.to(dev), feats[L:root][None].to(dev), cache,
                               torch.tensor([L], device=dev), torch.tensor([num], device=dev))
            h_root = out[:, -1:]
            L = root
            # ---- tree drafting
            lp = torch.log_softmax(draft.logits(h_root)[0, 0], -1)
            sc, ix = lp.topk(top_k)
            cand_score = sc.tolist()
            cand_tok = draft.to_target_ids(ix).tolist()
            cand_parent = [-1] * top_k
            frontier = list(range(top_k))            # candidate indices to feed next
            frontier_hidden = h_root.expand(1, top_k, -1)
            slot_of = {}                              # candidate index -> tree-state slot
            state = draft.new_tree(1)
            for d in range(1, depth):
                k = len(frontier)
                inp = torch.tensor([[cand_tok[c] for c in frontier]], device=dev)
                par = torch.tensor([[slot_of.get(cand_parent[c], -1) for c in frontier]], device=dev)
                posn = torch.full((1, k), L + d - 1, device=dev)
                base = state.num_nodes
                hid = draft.tree_step(inp, frontier_hidden, par, posn, cache,
                                      torch.tensor([L], device=dev), state)
                for j, c in enumerate(frontier):
                    slot_of[c] = base + j
                lp = torch.log_softmax(draft.logits(hid[0]), -1)          # [k, Vd]
                sc, ix = lp.topk(top_k, dim=-1)
                tix = draft.to_target_ids(ix)
                new = []
                for j, c in enumerate(frontier):
                    for t in range(top_k):
                        cand_score.append(cand_score[c] + float(sc[j, t]))
                        cand_tok.append(int(tix[j, t]))
                        cand_parent.append(c)
                        new.append((cand_score[-1], len(cand_score) - 1, j))
                new.sort(key=lambda x: -x[0])
                chosen = new[:top_k]
                frontier = [ci for _, ci, _ in chosen]
                frontier_hidden = hid[:, [j for _, _, j in chosen]]
            # ---- rerank: top `nodes` by effective score (closed under ancestors)
            eff = []
            for c, s in enumerate(cand_score):
                p = cand_parent[c]
                eff.append(min(s, eff[p]) if p >= 0 else s)
            order = sorted(range(len(eff)), key=lambda c: (-eff[c], c))[:nodes]
            chosen = set(order)
            # ---- greedy verification along the recorded tokens
            cur, acc = -1, 0
            while root + acc + 1 < n:
                want = int(toks[root + acc + 1])
                nxt = next((c for c in sorted(chosen) if cand_parent[c] == cur and cand_tok[c] == want), None)
                if nxt is None:
                    break
                cur, acc = nxt, acc + 1
            hist[acc] += 1
            total_acc += acc
            rounds += 1
            root = root + acc + 1    # accepted + bonus; the bonus is the next root
            if max_rounds is not None and rounds >= max_rounds:
                break
        total_rounds += rounds
    tau = 1.0 + total_acc / max(1, total_rounds)
    return {"tau": tau, "rounds": total_rounds, "accept_hist": hist, "top_k": top_k,
            "depth": depth, "nodes": nodes, "seqs": len(seqs)}


def load_draft(src, target):
    """A draft for evaluation (float32, eval mode) from an exported draft directory or a
    training checkpoint."""
    src = os.fspath(src)
    if os.path.isdir(src):
        from ..models.draft import Eagle3Draft

        draft = Eagle3Draft.from_pretrained(src, target=target, dtype=torch.float32)
    elif os.path.isfile(src):
        st = torch.load(src, map_location="cpu", weights_only=False)
        d2t = st["draft"]["d2t"]
        draft = new_draft(target, d2t + torch.arange(d2t.numel()), init_from_target=False,
                          intermediate_size=mlp_width(st["draft"]))
        draft.load_state_dict(st["draft"])
    else:
        raise FileNotFoundError(f"no draft directory or checkpoint at {src}")
    return draft.eval()


def conditional_acceptance(accept_hist: list[int]) -> list[float]:
    """Per draft position i (0-based) of a chain: P(position i accepted | positions < i were),
    from a chain simulation's histogram of accepted lengths."""
    out = []
    for i in range(len(accept_hist) - 1):
        reached = sum(accept_hist[i:])
        out.append(sum(accept_hist[i + 1:]) / reached if reached else float("nan"))
    return out


def benchmark_sequences(target, set_name: str, n: int, max_new_tokens: int = 256,
                        target_dir=None, batch: int = 16) -> list[Sequence_]:
    """Greedy target answers (with taps) to the first ``n`` prompts of a benchmark set, in
    memory, for an acceptance estimate on that set. Never written to disk or trained on."""
    from transformers import AutoTokenizer

    from ..datasets import load_prompts
    from .distill import _eos_ids, chat_ids, generate_with_taps

    if target_dir is None:
        from ..defaults import default_target_dir

        target_dir = default_target_dir()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = load_prompts(set_name, n=n)
    eos = _eos_ids(tok, target)
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        res = generate_with_taps(target, [chat_ids(tok, p.text) for p in chunk], max_new_tokens,
                                 eos, pad_id=tok.pad_token_id if tok.pad_token_id is not None else eos[0])
        out.extend(Sequence_(prompt_id=p.id, tokens=r["tokens"], prompt_len=r["prompt_len"],
                             features=r["features"], final_hidden=r["final_hidden"],
                             finished=r["finished"], target_argmax=r["target_argmax"])
                   for p, r in zip(chunk, res))
    return out


# ----------------------------------------------------------------------------- export


def revocab(draft, target, kept_new: torch.Tensor):
    """The same draft over another draft vocabulary ``kept_new``. Only valid for a draft whose
    lm_head is the target's output rows (trained with ``freeze_lm_head``): the new lm_head is
    the target's rows for ``kept_new``, every other weight is copied."""
    head = _target_head(target)
    old_ids = draft.to_target_ids(torch.arange(draft.config.draft_vocab_size))
    if torch.equal(old_ids.cpu(), kept_new.to(old_ids.dtype).cpu()):
        return draft    # the same vocabulary: nothing to do, whatever the head
    if not torch.allclose(draft.lm_head.weight.float(), head[old_ids], atol=1e-6):
        raise ValueError("revocab needs a draft whose lm_head equals the target's rows "
                         "(trained with freeze_lm_head=True)")
    new = new_draft(target, kept_new, init_from_target=False,
                    intermediate_size=draft.config.intermediate_size)
    sd = {k: v for k, v in draft.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = new.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight", "d2t", "t2d"}, (missing, unexpected)
    with torch.no_grad():
        new.lm_head.weight.copy_(head[new.to_target_ids(torch.arange(new.config.draft_vocab_size))])
    return new


def training_machine(device, threads: int) -> dict:
    """Where a run trains, for ``training_info.json``: the GPU's name, or the CPU's model and
    the flags its speed depends on (``costmodel.CPU_FLAGS``), the threads and torch."""
    from ..costmodel import _cpu_info

    dev = torch.device(device)
    where = ({"device": "cuda", "gpu": torch.cuda.get_device_name(dev)} if dev.type == "cuda"
             else {"device": dev.type, **_cpu_info(), "threads": int(threads)})
    return {**where, "torch": torch.__version__}


def lineage_tokens(tokens_seen, warm) -> int:
    """The tokens a draft saw in its own run plus those of every run it was warm-started from
    (``warm``: its ``warm_start`` record, which carries the chain's sum before it)."""
    before = warm.get("tokens_seen_lineage") if isinstance(warm, dict) else 0
    return int(tokens_seen or 0) + int(before or 0)


def warm_start_info(src, ckpt: dict | None = None) -> dict | None:
    """What a warm-started run started from, for ``training_info.json``: the path and, when it is
    an exported draft (its ``training_info.json``) or a training checkpoint, how that draft was
    trained: steps, tokens, time, machines and its own ``warm_start`` (nested, so a chain of
    warm-started runs keeps its whole history). ``tokens_seen_lineage``: the tokens of every run
    in the chain. Read when the run starts (the source may be overwritten later: the shipped
    draft's directory is where a better draft is exported to). ``ckpt``: the checkpoint at
    ``src`` when the caller has already loaded it."""
    if not src:
        return None
    src, info = Path(src), {"from": str(src)}
    try:
        if (src / "training_info.json").is_file():
            prev = json.loads((src / "training_info.json").read_text())
            data = prev.get("data") or {}
            info["data"] = [[m.get("dir_name"), m.get("response_tokens")] for m in data.get("mix", [data])
                            if isinstance(m, dict)]
        elif src.is_file():
            prev = ckpt if ckpt is not None else torch.load(src, map_location="cpu", weights_only=False)
            prev = {**prev, "ttt_steps": (prev.get("config") or {}).get("ttt_steps")}
        else:
            return info
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError):
        return info
    for k in ("step", "tokens_seen", "train_seconds", "ttt_steps", "machines", "warm_start"):
        info[k] = prev.get(k)
    info["tokens_seen_lineage"] = lineage_tokens(prev.get("tokens_seen"), prev.get("warm_start"))
    return info


def export_draft(checkpoint, dest, target=None, vocab_file=None) -> Path:
    """Load a training checkpoint (``ckpt_*.pt``) and write the draft with ``save_pretrained``
    (public EAGLE-3 layout, fp16) to ``dest``; also writes ``training_info.json``.
    ``vocab_file`` (a ``vocab`` command output): export over that draft vocabulary instead
    (see ``revocab``; needs a frozen-lm_head run)."""
    st = torch.load(checkpoint, map_location="cpu", weights_only=False)
    cfg = st["config"]
    target = target if target is not None else load_target_for_training(cfg.get("target_dir"))
    d2t = st["draft"]["d2t"]
    kept = d2t + torch.arange(d2t.numel())
    draft = new_draft(target, kept, init_from_target=False, intermediate_size=mlp_width(st["draft"]))
    draft.load_state_dict(st["draft"])
    trained_vocab = int(kept.numel())
    if vocab_file is not None:
        draft = revocab(draft, target, load_vocab(vocab_file))
    L = getattr(target.config, "num_hidden_layers", None)
    if L is not None and draft.config.aux_layers is None:
        # self-describing taps (written in vLLM's reading, models.draft.aux_layers_from_ids)
        from .distill import aux_layer_ids

        draft.config.aux_layers = tuple(aux_layer_ids(L))
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / ".export.tmp"
    tmp.mkdir(exist_ok=True)
    draft.save_pretrained(str(tmp), dtype=torch.float16)
    for name in ("config.json", "model.safetensors"):
        os.chmod(tmp / name, 0o644)
        os.replace(tmp / name, dest / name)
    tmp.rmdir()
    hist = st.get("history") or []
    warm = st.get("warm_start")
    if warm is None and cfg.get("init_from"):
        # a checkpoint from before runs recorded it: read the source now, unless it is the
        # directory being exported to (it would describe this draft, not its parent)
        same = Path(cfg["init_from"]).resolve() == dest.resolve()
        warm = {"from": cfg["init_from"]} if same else warm_start_info(cfg["init_from"])
    info = {"step": st["step"], "tokens_seen": st.get("tokens_seen"),
            "tokens_seen_lineage": lineage_tokens(st.get("tokens_seen"), warm),
            "ttt_steps": cfg.get("ttt_steps"), "ttt_history": st.get("ttt_history"),
            "train_seconds": st.get("train_seconds"),
            "machines": st.get("machines"), "warm_start": warm,
            "data": training_data_info(cfg.get("data_dir")),
            "trained_draft_vocab": trained_vocab, "draft_vocab": int(draft.config.draft_vocab_size),
            "vocab_file": str(vocab_file) if vocab_file else None,
            "last_eval": hist[-1] if hist else None,
            "train_config": {k: v for k, v in cfg.items() if k not in ("data_dir", "run_dir")},
            "method": "EAGLE-3 self-distillation on heterospec.train.prompts (see docs)"}
    (dest / "training_info.json").write_text(json.dumps(info, indent=1))
    return dest


def training_data_info(data_dir) -> dict | None:
    """What ``training_info.json`` says about the data: prompt sources with their licences,
    prompts per source, the disjointness report, generation dtype, response tokens (from the
    distillation manifest and shards). A directory of shards linked from several data sets (how
    a run mixes them: docs/gpu.md, ``scripts/gpu_session.sh``) is described per set, each with
    the shards it gave, under ``"mix"``. None when ``data_dir`` is unknown or gone, or a shard's
    set has no manifest."""
    if not data_dir or not Path(data_dir).is_dir():
        return None
    d = Path(data_dir)
    shards = list_shards(d)
    if (d / "manifest.json").exists():
        return _data_set_info(d, shards)
    by_set: dict[Path, list[Path]] = {}       # set directory -> its shards, links resolved
    for p in map(Path.resolve, shards):
        by_set.setdefault(p.parent, []).append(p)
    if not by_set or any(not (s / "manifest.json").exists() for s in by_set):
        return None
    parts = [{**_data_set_info(s, used), "shards_used": sorted(p.name for p in used),
              "shards_in_set": len(list_shards(s))} for s, used in sorted(by_set.items())]
    return {"dir_name": d.name, "mix": parts,
            **{k: sum(part[k] for part in parts) for k in ("shards", "sequences", "response_tokens", "tokens")}}


def _data_set_info(d: Path, shards: list[Path]) -> dict:
    """:func:`training_data_info` of one distilled set ``d`` (its manifest), counting ``shards``."""
    man = json.loads((d / "manifest.json").read_text())
    prompts = man.get("prompts") or {}
    resp = total = seqs = 0
    for p in shards:
        sh = DistillShard(p)
        resp += sh.num_response_tokens
        total += int(sh.tokens.numel())
        seqs += len(sh)
    info = {"dir_name": d.name, "shards": len(shards), "sequences": seqs,
            "response_tokens": resp, "tokens": total,
            "generation_dtype": man.get("generation_dtype"),
            "distill_config": man.get("config"),
            "sources": prompts.get("sources"), "prompts_per_source": prompts.get("counts"),
            "disjointness": prompts.get("disjointness")}
    if info["sources"] is None:  # data from before source bookkeeping (the shipped draft's)
        from .prompts import source_info

        info["sources"] = source_info(["instruct", "code", "docs", "math"])
    return info


# ----------------------------------------------------------------------------- CLI glue


def cli_dispatch(args, default_data, default_run) -> int:
    data = getattr(args, "data", None) or default_data()
    if args.cmd == "vocab":
        info = build_vocab(data, args.size, out=args.out)
        print(json.dumps({k: v for k, v in info.items() if k not in ("kept", "shards")}, indent=1))
        return 0
    run = getattr(args, "run", None) or default_run()
    if args.cmd == "train":
        cfg = TrainConfig(data_dir=data, run_dir=run, vocab_size=args.vocab_size, steps=args.steps,
                          batch_tokens=args.batch_tokens, max_len=args.max_len,
                          ttt_steps=args.ttt_steps, lr=args.lr, warmup=args.warmup,
                          min_lr_ratio=args.min_lr_ratio, val_seqs=args.val_seqs,
                          eval_every=args.eval_every,
                          ckpt_every=args.ckpt_every, time_budget_s=args.time_budget,
                          stop_at=args.stop_at,
                          seed=args.seed, threads=args.threads, target_dir=args.target,
                          init_from=args.init, init_layer=args.init_layer, amp=args.amp,
                          intermediate_size=args.intermediate_size,
                          taps_dtype=args.taps_dtype, device=args.device,
                          freeze_lm_head=not args.train_lm_head)
        tr = Trainer(cfg)
        print(json.dumps(tr.fit(), indent=1), flush=True)
        return 0
    torch.set_num_threads(max(1, args.threads))
    if args.cmd == "simulate":
        target = load_target_for_training(args.target)
        draft = load_draft(args.checkpoint or str(Path(run) / "ckpt_latest.pt"), target)
        if args.prompts:
            seqs = benchmark_sequences(target, args.prompts, args.seqs, args.max_new_tokens,
                                       target_dir=args.target)
        else:
            refs = validation_sequences(data, 10 ** 9, greedy_only=True)[: args.seqs]
            seqs = sequences_with_taps(load_sequences(data, refs), target)
        res = simulate_acceptance(draft, seqs, top_k=args.top_k, depth=args.depth, nodes=args.nodes)
        chain = simulate_acceptance(draft, seqs, top_k=1, depth=args.depth, nodes=args.depth)
        print(json.dumps({"tree": res, "chain": chain}, indent=1))
        return 0
    if args.cmd == "export":
        from ..defaults import DRAFT_ASSET_DIR

        src = args.checkpoint or str(Path(run) / "ckpt_best.pt")
        if not os.path.exists(src):
            src = str(Path(run) / "ckpt_latest.pt")
        dest = export_draft(src, args.dest or DRAFT_ASSET_DIR,
                            target=load_target_for_training(args.target), vocab_file=args.vocab)
        print(f"exported {src} -> {dest}")
        return 0
    raise SystemExit(f"unknown command {args.cmd}")
