"""A copy of an EAGLE-3 draft whose vocabulary splits across ``tp`` tensor-parallel ranks in vLLM.

vLLM shards the draft's lm_head by vocabulary rows: it pads the draft vocabulary to a multiple
of 64 and needs the result to divide evenly by the tensor-parallel size. The shipped draft has
8,192 rows, which split in 2, 4 or 8 but not in 3, while the built-in target (9 attention
heads, 3 KV heads) splits in 3 only: vLLM stops with ``AssertionError: 8192 is not divisible by 3``
deep in a worker. :func:`write_tp_draft` writes the same draft over a vocabulary padded to the
next multiple of ``lcm(64, tp)`` (8,256 rows at TP 3): the added rows are the lowest target ids
the draft did not cover, with the target's own output rows, so they score as the target would
score them (the draft's trained rows are kept as they are). Every other weight, the chain and
tree tables and the entropy bins are copied: the added tokens are ones the draft vocabulary left
out as rare, so the acceptance the tables hold is the draft's. The ids stay sorted, so the map
``d2t`` still rises with the draft's ids.

Run ``python -m heterospec.vllm_plugin tp-draft --tp 3 --out DIR`` (the built-in pair by default).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Optional

# vLLM pads a vocabulary-parallel embedding or head to a multiple of this many rows
# (vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE)
VOCAB_PADDING = 64


def padded_vocab(rows: int, padding: int = VOCAB_PADDING) -> int:
    """The rows vLLM gives a vocabulary-parallel head of ``rows`` rows (before splitting it)."""
    return -(-rows // padding) * padding


def splits(rows: int, tp: int) -> bool:
    """Whether vLLM can shard a draft head of ``rows`` rows across ``tp`` ranks."""
    return padded_vocab(rows) % tp == 0


def split_rows(rows: int, tp: int, vocab: int) -> int:
    """The smallest draft vocabulary of at least ``rows`` rows that splits across ``tp`` ranks
    (at most the target's ``vocab``)."""
    unit = math.lcm(VOCAB_PADDING, tp)
    out = -(-rows // unit) * unit
    if out > vocab:
        raise ValueError(f"no draft vocabulary between {rows} and the target's {vocab} tokens splits "
                         f"across {tp} tensor-parallel ranks")
    return out


def _heads(cfg: dict, what: str, tp: int) -> None:
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = cfg.get(key)
        if n is not None and int(n) % tp:
            raise ValueError(f"the {what}'s {n} {key.replace('num_', '').replace('_', ' ')} do not split "
                             f"across {tp} tensor-parallel ranks: vLLM cannot run it at tensor_parallel_size={tp}")


def _target_head(target_dir: Path):
    """The target's output rows (its lm_head, or the tied input embedding), any dtype."""
    from safetensors import safe_open
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in the target directory {target_dir}")
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for f in files:
            with safe_open(str(f), "pt") as fh:
                if name in fh.keys():
                    return fh.get_tensor(name)
    raise ValueError(f"the target in {target_dir} has neither lm_head.weight nor model.embed_tokens.weight")


def write_tp_draft(draft_dir, target_dir, out_dir, tp: int) -> dict:
    """Write a copy of the EAGLE-3 draft in ``draft_dir`` to ``out_dir`` whose vocabulary vLLM can
    shard across ``tp`` ranks (see the module). Returns what was done (also saved as
    ``out_dir/tp_draft.json``). Raises ``ValueError`` naming the problem where the draft or the
    target cannot run at that size, or the draft already splits."""
    import torch
    from safetensors.torch import load_file, save_file

    draft_dir, target_dir, out_dir = Path(draft_dir), Path(target_dir), Path(out_dir)
    if not isinstance(tp, int) or tp < 2:
        raise ValueError(f"tp must be an integer >= 2, got {tp!r}")
    for d, what in ((draft_dir, "draft"), (target_dir, "target")):
        if not (d / "config.json").is_file():
            raise ValueError(f"the {what} directory {d} has no config.json")
    if out_dir.resolve() == draft_dir.resolve():
        raise ValueError("--out must be another directory than the draft's")
    cfg = json.loads((draft_dir / "config.json").read_text())
    tcfg = json.loads((target_dir / "config.json").read_text())
    _heads(tcfg, "target", tp)
    _heads(cfg, "draft", tp)
    vocab = int(cfg.get("vocab_size") or tcfg["vocab_size"])
    rows = int(cfg.get("draft_vocab_size") or vocab)
    if splits(rows, tp):
        raise ValueError(f"the draft's {rows}-token vocabulary already splits across {tp} ranks: use the draft as it is")
    new_rows = split_rows(rows, tp, vocab)

    weights = load_file(str(draft_dir / "model.safetensors"))
    head = weights["lm_head.weight"]
    if "d2t" in weights:
        kept = torch.arange(rows, dtype=torch.long) + weights["d2t"].long()
    else:                                   # a full-vocabulary head has no map
        kept = torch.arange(rows, dtype=torch.long)
    target_head = _target_head(target_dir)
    if tuple(target_head.shape) != (vocab, head.shape[1]):
        raise ValueError(f"the target's output rows are {tuple(target_head.shape)}, the draft needs ({vocab}, {head.shape[1]})")
    covered = torch.zeros(vocab, dtype=torch.bool)
    covered[kept] = True
    added = torch.nonzero(~covered).flatten()[: new_rows - rows]
    ids, order = torch.sort(torch.cat([kept, added]))
    rows_of = torch.cat([head, target_head[added].to(head.dtype)])[order]
    weights["lm_head.weight"] = rows_of.contiguous()
    weights["d2t"] = (ids - torch.arange(new_rows)).to(weights.get("d2t", ids).dtype)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    weights["t2d"] = t2d

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"))
    cfg["draft_vocab_size"] = new_rows
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in draft_dir.iterdir():             # tables, bins, training info, README
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "tp_draft.json"):
            shutil.copy2(f, out_dir / f.name)
    info = {"from": str(draft_dir.resolve()), "tp": tp, "draft_vocab": rows, "tp_draft_vocab": new_rows,
            "added_target_ids": added.tolist(),
            "why": "vLLM shards the draft's lm_head by rows (padded to a multiple of 64) evenly across TP ranks"}
    (out_dir / "tp_draft.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def vocab_error(draft_rows: Optional[int], tp: int, draft_dir: str) -> Optional[str]:
    """The message for a draft vocabulary that vLLM cannot shard across ``tp`` ranks, or None."""
    if draft_rows is None or tp <= 1 or splits(int(draft_rows), tp):
        return None
    return (f"HeteroSpec: the EAGLE-3 draft's {draft_rows}-token vocabulary does not split across {tp} "
            f"tensor-parallel ranks (vLLM pads it to {padded_vocab(int(draft_rows))} rows and shards them evenly). "
            f"Write a copy whose vocabulary does: `python -m heterospec.vllm_plugin tp-draft --tp {tp} "
            f"--draft {draft_dir} --out DIR`, and pass DIR as speculative_config['model']")
