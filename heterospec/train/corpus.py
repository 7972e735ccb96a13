"""Build the lookup corpus shipped next to the draft (:mod:`heterospec.datastore`).

The corpus is the target's own greedy answers in the distilled data (``data/distill-v*``), each
preceded by the last ``head`` tokens of its prompt (the chat template's assistant header, so an
answer's opening is found from the header alone), documents separated by
:data:`heterospec.datastore.SEP`. Sampled answers (temperature 0.7) are left out: a chain is
worth what the target would write at greedy. The prompts behind the answers come from sources
checked against every benchmark set and the calibration split when the data was built (each
directory's ``disjointness.json``); a directory without that record is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from ..datastore import SEP, save_corpus


def corpus_tokens(data_dirs: Sequence[str], head: int = 3, greedy_only: bool = True) -> tuple:
    """``(tokens, info)``: the concatenated documents and what went in (per directory: answers,
    response tokens), in directory and shard order."""
    from safetensors.numpy import load_file     # (token fields only: DistillShard also rebuilds argmax rows)

    from .distill import list_shards

    parts: List[np.ndarray] = []
    info: Dict[str, dict] = {}
    vocab = None
    sep = np.array([SEP], np.uint16)
    for d in data_dirs:
        d = Path(d)
        manifest = d / "manifest.json"
        if not manifest.is_file():
            raise ValueError(f"{d}: no manifest.json (not a distilled data directory)")
        m = json.loads(manifest.read_text())
        if not (d / "disjointness.json").is_file() or not (m.get("config") or {}).get("disjoint", False):
            raise ValueError(f"{d}: its prompts were not checked against the benchmark sets (no disjointness.json "
                             f"or config.disjoint false); the lookup corpus takes only checked data")
        v = int(m.get("vocab_size", 0)) or None
        if vocab is not None and v is not None and v != vocab:
            raise ValueError(f"{d}: vocabulary {v}, the directories before it have {vocab}")
        vocab = v or vocab
        shards = list_shards(d)
        if not shards:
            raise ValueError(f"{d}: no shard_*.safetensors")
        answers = tokens = 0
        for f in shards:
            s = load_file(str(f))
            so, pl, tk, sm = s["seq_offsets"], s["prompt_lens"], s["tokens"], s["sampled"]
            for i in range(len(pl)):
                if greedy_only and sm[i]:
                    continue
                seq = tk[so[i]:so[i + 1]]
                p = int(pl[i])
                if len(seq) <= p:
                    continue
                parts.append(seq[max(p - head, 0):].astype(np.uint16))
                parts.append(sep)
                answers += 1
                tokens += len(seq) - p
        info[str(d)] = {"answers": answers, "response_tokens": tokens}
    if not parts:
        raise ValueError("no answers in the given directories")
    return np.concatenate(parts), {"sources": info, "vocab_size": vocab, "head": head, "greedy_only": greedy_only}


def build_corpus(data_dirs: Sequence[str], out: str, head: int = 3) -> dict:
    """Write ``out`` (``lookup_corpus.npz``) from ``data_dirs``; returns its meta."""
    tokens, meta = corpus_tokens(data_dirs, head=head)
    meta.update({"tokens": int(len(tokens)),
                 "what": "the target's greedy answers to the draft's training prompts (heterospec.datastore)"})
    save_corpus(out, tokens, meta)
    meta["bytes"] = Path(out).stat().st_size
    return meta
