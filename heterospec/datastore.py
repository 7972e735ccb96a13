"""Datastore lookup: draft chains retrieved from the target's own earlier answers.

Context lookup (:mod:`heterospec.lookup`) copies from the request itself and from the requests
before it. A small target also answers *unseen* requests in phrases it has written many times
before: openings ("Sure! Here are ..."), the steps of a worked problem, the scaffolding of a code
answer, the connective tissue of an explanation. A datastore of the target's own greedy answers
to many prompts holds those phrases, and the continuation that most often followed the longest
match of a request's last tokens there is a draft chain that costs no draft forward (retrieval-
based speculative decoding, as REST does with a general corpus; ours is the target's own text,
so its continuations are the target's).

The shipped datastore (``lookup_corpus.npz`` next to the draft) holds the target's greedy answers
to the draft's training prompts (``data/distill-v*``: prompts from sources disjoint from every
benchmark set and the calibration split, checked when the data was built), each with the last
tokens of its prompt (the chat template's assistant header), documents separated by :data:`SEP`.
``heterospec train-draft corpus`` builds it.

Layout (``torch.ops.heterospec.corpus_lookup``, which does the lookup): the corpus as int32 token
ids; read backwards it is ``rev``, and ``suffix_order`` holds the positions of ``rev`` sorted by
their first :attr:`CorpusIndex.NMAX` tokens. The suffixes of ``rev`` that start with a request's
last ``n`` tokens *reversed* form one range of ``suffix_order``, and the range for ``n + 1`` tokens
lies inside it, so the longest match is found by narrowing one range a token at a time.

How often a chain of each grade is accepted, and whether a round verifies it at all, is the
lookup gate's to learn and price (:class:`heterospec.lookup.LookupGate`, source ``"corpus"``).
Runtime only: numpy and the op, no tooling imports.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

# Document separator (tokens are uint16; a vocabulary must stay below it).
SEP = 0xFFFF
FORMAT = 1


class CorpusIndex:
    """A token datastore indexed for the longest match of a context's suffix (see the module
    docstring for the layout). ``tokens``: 1-D integer array, documents separated by
    :data:`SEP`, every token below it. ``cache_dir``: where the suffix order is kept between
    processes (its build sorts the whole corpus once: ~2 s for 3.4 M tokens on a 2-core CPU);
    None keeps nothing."""

    NMAX = 16           # longest match looked for (tokens)
    MIN_MATCH = 3       # shorter matches propose nothing: their chains were accepted ~0.2 of a token
    SAMPLE = 64         # occurrences of the match read for its continuation (evenly spaced)
    AGREE = 0.5         # a chain ends where fewer than this share of the occurrences still agree

    def __init__(self, tokens, cache_dir: Optional[str] = None, meta: Optional[dict] = None) -> None:
        t = np.asarray(tokens)
        if t.ndim != 1 or t.size == 0:
            raise ValueError(f"CorpusIndex: tokens must be a non-empty 1-D array, got shape {tuple(t.shape)}")
        if not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"CorpusIndex: tokens must be integers, got {t.dtype}")
        if int(t.min()) < 0 or int(t.max()) > SEP:
            raise ValueError(f"CorpusIndex: tokens must lie in [0, {SEP}] ({SEP} separates documents), "
                             f"got [{int(t.min())}, {int(t.max())}]")
        self.meta = dict(meta or {})
        fwd = t.astype(np.uint16)
        self.N = len(fwd)
        self.key = hashlib.sha1(fwd.tobytes()).hexdigest()[:16]
        self._tokens = torch.from_numpy(fwd.astype(np.int32))
        self._order = torch.from_numpy(self._suffix_order(fwd, cache_dir))

    def __len__(self) -> int:
        return self.N

    def tokens(self) -> np.ndarray:
        """The corpus (uint16; documents separated by :data:`SEP`)."""
        return self._tokens.numpy().astype(np.uint16)

    def _suffix_order(self, fwd: np.ndarray, cache_dir: Optional[str]) -> np.ndarray:
        path = Path(cache_dir) / f"{self.key}.sa{self.NMAX}.npy" if cache_dir else None
        if path is not None and path.is_file():
            try:
                sa = np.load(path)
                if sa.shape == (self.N,) and sa.dtype == np.int32:
                    return sa
            except (OSError, ValueError):
                pass
        # the suffixes of rev, sorted by their first NMAX tokens packed four to a uint64 key
        # (16 bits a token, the first in the high bits; SEP past the corpus start)
        rev = np.concatenate([fwd[::-1], np.full(self.NMAX, SEP, np.uint16)])
        words = []
        for w in range(self.NMAX // 4):
            key = np.zeros(self.N, np.uint64)
            for j in range(4):
                key = (key << np.uint64(16)) | rev[4 * w + j:4 * w + j + self.N].astype(np.uint64)
            words.append(key)
        sa = np.lexsort(words[::-1]).astype(np.int32)      # the first word is the primary key
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, sa)
                os.replace(tmp, path)
            except OSError:
                pass           # a read-only cache: the next process sorts again
        return sa

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, context: Sequence[int], k: int) -> Tuple[List[int], List[int]]:
        """``(chain, [n, count, rows, agreeing])`` of :func:`heterospec.ops.corpus_lookup` for
        ``context`` (its last ``NMAX`` tokens), with this index's settings."""
        ctx = torch.tensor(list(context[-self.NMAX:]), dtype=torch.int64)
        # the op itself, not its Python wrapper: the index built its arguments, and the kernel
        # checks them again (a lookup is asked every round)
        chain, match = torch.ops.heterospec.corpus_lookup.default(self._tokens, self._order, ctx, k, self.MIN_MATCH,
                                                                  self.NMAX, self.SAMPLE, float(self.AGREE))
        return [t for t in chain.tolist() if t >= 0], match.tolist()

    def match(self, context: Sequence[int]) -> Tuple[int, int]:
        """``(n, count)``: the longest ``n <= NMAX`` for which the last ``n`` tokens of
        ``context`` occur in the corpus, and how often they do; ``(0, 0)`` without one."""
        _, (n, count, _, _) = self.lookup(context, 0)
        return n, count

    # A chain's grade (1-5) says how far its first token is to be trusted, from the share of the
    # occurrences read that continue with it (agreement) and how many do (support); the lookup
    # gate keeps its acceptance per grade (lookup.proposal_row). On held-out greedy answers of the
    # five benchmark sets, where the request's own context had no match of 4 or more, the first
    # token was the target's in 88 % of grade-5 proposals and ~20 % of agreements below 0.7: the
    # match length alone separated 32 % (3 tokens) from 63 % (9 or more).
    TRUST_AGREE = 0.95       # grades 3-5: (nearly) all occurrences agree
    LIKELY_AGREE = 0.7       # grade 4 below TRUST_AGREE
    TRUST_SUPPORT = 5        # grade 5: at least this many occurrences agree
    LONG_MATCH = 6           # a single occurrence is grade 3 from this match length, else 2

    def propose(self, context: Sequence[int], k: int) -> Tuple[List[int], int]:
        """``(chain, grade)``: up to ``k`` tokens, the continuation most of the occurrences of
        the longest match (``n`` >= ``MIN_MATCH`` tokens) of ``context``'s suffix agree on,
        position by position among those that agreed so far; it ends where fewer than ``AGREE``
        of them agree, or at the end of a document. ``grade`` (1-5, 5 most trusted) grades its
        first token (see ``TRUST_AGREE``). ``([], 0)`` without a chain."""
        if k < 1:
            return [], 0
        chain, (n, _, rows, agree) = self.lookup(context, k)
        if not chain:
            return [], 0
        if agree >= self.TRUST_AGREE * rows:
            grade = 5 if agree >= self.TRUST_SUPPORT else 4 if agree > 1 else 3 if n >= self.LONG_MATCH else 2
        else:
            grade = 4 if agree >= self.LIKELY_AGREE * rows else 2
        return chain, grade

    # -- files -------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """The corpus as a compressed ``.npz`` (tokens and meta; the index is rebuilt on load)."""
        save_corpus(path, self.tokens(), self.meta)

    @classmethod
    def load(cls, path: str, cache_dir: Optional[str] = None) -> "CorpusIndex":
        """A corpus written by :meth:`save`."""
        with np.load(path) as z:
            if "tokens" not in z.files:
                raise ValueError(f"{path}: not a lookup corpus (no 'tokens' array)")
            meta = json.loads(bytes(z["meta"]).decode()) if "meta" in z.files else {}
            if int(meta.get("format", FORMAT)) != FORMAT:
                raise ValueError(f"{path}: lookup corpus format {meta.get('format')}, this version reads {FORMAT}")
            return cls(z["tokens"], cache_dir=cache_dir, meta=meta)


def save_corpus(path: str, tokens, meta: Optional[dict] = None) -> None:
    """Tokens (documents separated by :data:`SEP`) and meta as a compressed ``.npz``, the file
    :meth:`CorpusIndex.load` reads."""
    np.savez_compressed(path, tokens=np.asarray(tokens, np.uint16),
                        meta=np.frombuffer(json.dumps({**(meta or {}), "format": FORMAT}).encode(), np.uint8))


CORPUS_FILE = "lookup_corpus.npz"
_loaded: Dict[Tuple[str, float], CorpusIndex] = {}


def corpus_for(draft_dir: Optional[str], vocab_size: Optional[int] = None) -> Optional[CorpusIndex]:
    """The lookup corpus shipped next to a draft (``lookup_corpus.npz``), loaded once per process
    and file version, its suffix order cached in ``<cache>/datastore``; None where the draft has
    none, where it was written for a target with another vocabulary (its tokens would be another
    tokenizer's), or where it cannot be read (both with a warning)."""
    if not draft_dir:
        return None
    path = os.path.join(str(draft_dir), CORPUS_FILE)
    if not os.path.isfile(path):
        return None
    key = (os.path.realpath(path), os.path.getmtime(path))
    index = _loaded.get(key)
    if index is None:
        from .fetch import cache_root
        cache = str(cache_root() / "datastore")      # (an unwritable one: sorted again in every process)
        try:
            index = CorpusIndex.load(path, cache_dir=cache)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            # a damaged file costs the lookups it would have given, not the engine
            warnings.warn(f"{path} could not be read ({exc}): the lookup corpus is not used", stacklevel=2)
            return None
        _loaded[key] = index
    want = index.meta.get("vocab_size")
    if vocab_size is not None and want is not None and int(want) != int(vocab_size):
        warnings.warn(f"{path} was built for a vocabulary of {want} tokens, the target has {vocab_size}: "
                      f"the lookup corpus is not used", stacklevel=2)
        return None
    return index
