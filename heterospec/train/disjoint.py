"""Strict disjointness of the draft's training prompts from every evaluation prompt set.

Every benchmark prompt set of ``heterospec.datasets`` (mtbench both turns, humaneval, gsm,
alpaca, cnndm) and the calibration split (``heterospec.train.prompts.calibration_prompts``) are
the *references*. A training prompt is dropped when, after normalisation (Unicode NFKC,
lower case, every run of non-alphanumeric characters -> one space):

* its text equals a reference's text (exact duplicate), or
* it shares word 8-grams with one reference such that ``shared / min(grams(prompt),
  grams(reference)) >= containment`` (default 0.5): a near duplicate, a prompt that contains a
  reference (e.g. a benchmark passage inside a longer prompt), or one contained in a reference;
* or it shares at least one word 8-gram with a reference and their word sequences are
  ``similarity`` (default 0.8, ``difflib`` ratio) alike: a near duplicate with a few words
  changed (one substituted word breaks up to 8 of the 8-grams of a short prompt).

Prompts / references shorter than 8 words have no 8-grams and are compared exactly. The
check is one pass over the candidates with a hash index of the references' 8-grams (tens of
thousands of prompts take seconds). ``filter_prompts`` returns the kept prompts and a report:
how many were dropped per reference set (a prompt overlapping two sets counts in both), with a
few examples.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = ["normalise", "ngrams", "OverlapIndex", "filter_prompts", "reference_sets",
           "benchmark_texts", "write_reference_file", "read_reference_file", "REFERENCES_ENV",
           "BENCHMARK_SETS", "CALIBRATION_DRAWS", "NGRAM", "CONTAINMENT"]

NGRAM = 8
CONTAINMENT = 0.5
SIMILARITY = 0.8
BENCHMARK_SETS = ("mtbench", "humaneval", "gsm", "alpaca", "cnndm")

_NON_ALNUM = re.compile(r"[^0-9a-z]+")


def normalise(text: str) -> str:
    """NFKC, lower case, runs of non-alphanumeric characters -> one space, stripped."""
    return _NON_ALNUM.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def ngrams(norm: str, n: int = NGRAM) -> set[int]:
    """Hashes of the word ``n``-grams of a normalised text (empty when it has fewer words)."""
    w = norm.split()
    return {hash(" ".join(w[i:i + n])) for i in range(len(w) - n + 1)}


@dataclass
class OverlapIndex:
    """Reference texts (per named set), indexed by exact normalised text and by word n-grams."""

    n: int = NGRAM
    containment: float = CONTAINMENT
    similarity: float = SIMILARITY
    exact: dict = field(default_factory=dict)           # normalised text -> set of set names
    gram_refs: dict = field(default_factory=lambda: defaultdict(list))  # gram -> [ref index]
    ref_set: list = field(default_factory=list)         # ref index -> set name
    ref_size: list = field(default_factory=list)        # ref index -> number of grams
    ref_words: list = field(default_factory=list)       # ref index -> normalised words
    sizes: dict = field(default_factory=Counter)        # set name -> references added

    def add(self, set_name: str, texts: Iterable[str]) -> None:
        for t in texts:
            norm = normalise(t)
            if not norm:
                continue
            self.sizes[set_name] += 1
            self.exact.setdefault(norm, set()).add(set_name)
            grams = ngrams(norm, self.n)
            if not grams:
                continue
            r = len(self.ref_set)
            self.ref_set.append(set_name)
            self.ref_size.append(len(grams))
            self.ref_words.append(norm.split())
            for g in grams:
                self.gram_refs[g].append(r)

    def overlaps(self, text: str) -> set[str]:
        """Names of the reference sets that ``text`` duplicates or near-duplicates."""
        norm = normalise(text)
        hit = set(self.exact.get(norm, ()))
        grams = ngrams(norm, self.n)
        if grams:
            shared: Counter = Counter()
            for g in grams:
                for r in self.gram_refs.get(g, ()):
                    shared[r] += 1
            words = None
            for r, k in shared.items():
                if self.ref_set[r] in hit:
                    continue
                if k >= self.containment * min(len(grams), self.ref_size[r]):
                    hit.add(self.ref_set[r])
                    continue
                words = norm.split() if words is None else words
                sm = difflib.SequenceMatcher(None, words, self.ref_words[r], autojunk=False)
                if sm.real_quick_ratio() >= self.similarity and sm.ratio() >= self.similarity:
                    hit.add(self.ref_set[r])
        return hit


def filter_prompts(prompts: Sequence, index: OverlapIndex, text=lambda p: p.text,
                   max_examples: int = 3) -> tuple[list, dict]:
    """(kept prompts, report). ``report``: ``candidates``, ``kept``, ``dropped`` (total),
    ``dropped_per_set`` {set: count}, ``reference_sizes`` {set: references}, ``examples``
    {set: [first prompts dropped for it]}, and the method."""
    kept, per_set, examples = [], Counter(), defaultdict(list)
    for p in prompts:
        hit = index.overlaps(text(p))
        if not hit:
            kept.append(p)
            continue
        for s in sorted(hit):
            per_set[s] += 1
            if len(examples[s]) < max_examples:
                examples[s].append(text(p)[:160])
    report = {
        "method": (f"drop exact duplicates and word-{index.n}-gram near duplicates "
                   f"(shared >= {index.containment:g} x min(grams), or >= 1 shared and word "
                   f"similarity >= {index.similarity:g}) of normalised text "
                   "(NFKC, lower case, non-alphanumerics -> space)"),
        "candidates": len(prompts), "kept": len(kept), "dropped": len(prompts) - len(kept),
        "dropped_per_set": {s: per_set.get(s, 0) for s in sorted(index.sizes)},
        "reference_sizes": dict(sorted(index.sizes.items())),
        "examples": dict(examples),
    }
    return kept, report


#: (n, seed) of the calibration-split draws that the project uses: ``heterospec calibrate``
#: (n 64, seed 0) with a margin (256), and ``bench/tune_tree.py`` (seed 7).
CALIBRATION_DRAWS = ((256, 0), (64, 0), (64, 7))


#: A file of benchmark texts (``write_reference_file``) for machines that cannot fetch a set's
#: data (the offline GPU host lacks python3.11-doc and reasoning-gym): a set missing there is
#: checked against the file's texts instead of being skipped.
REFERENCES_ENV = "HETEROSPEC_DISJOINT_REFS"


def benchmark_texts(name: str, gsm_n: int = 1000, cnndm_n: int | None = None) -> list[str]:
    """The reference texts of one benchmark set (raises ``MissingDataError`` without its data).
    Fixed sets whole (mtbench: both turns); the generated ones larger than the benchmarks use
    (gsm: ``gsm_n`` prompts, 5x the benchmark's 200; cnndm: every eval-split passage)."""
    from .. import datasets as DS

    if name == "mtbench":
        return [p.text for t in (0, 1) for p in DS.load_prompts("mtbench", turn=t)]
    if name == "gsm":
        return [p.text for p in DS.load_prompts("gsm", n=gsm_n)]
    if name == "cnndm":
        return [p.text for p in DS.load_prompts("cnndm", n=cnndm_n or 10 ** 9)]
    return [p.text for p in DS.load_prompts(name)]


def write_reference_file(path, sets: Sequence[str] = BENCHMARK_SETS) -> dict:
    """Write every named set's reference texts to ``path`` (gzipped JSON {set: [texts]}, a few
    hundred KB); needs every set's data here. Returns {set: number of texts}."""
    import gzip
    import json
    import os

    data = {name: benchmark_texts(name) for name in sets}
    tmp = f"{path}.tmp{os.getpid()}"
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump({"format": "heterospec-disjoint-refs-v1", "sets": data}, f)
    os.replace(tmp, path)
    return {k: len(v) for k, v in data.items()}


def read_reference_file(path) -> dict[str, list[str]]:
    """{set: [texts]} from a file of ``write_reference_file``; a clear error for anything else."""
    import gzip
    import json

    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a reference file of heterospec train-draft references ({exc})") from exc
    ok = isinstance(doc, dict) and doc.get("format") == "heterospec-disjoint-refs-v1"
    sets = doc.get("sets") if ok else None
    if not isinstance(sets, dict) or not all(
            isinstance(v, list) and all(isinstance(t, str) for t in v) for v in sets.values()):
        raise ValueError(f"{path}: not a reference file of heterospec train-draft references")
    return sets


def reference_sets(calibration=CALIBRATION_DRAWS, gsm_n: int = 1000, cnndm_n: int | None = None,
                   allow_missing: bool = False, log=print) -> OverlapIndex:
    """The index over every benchmark set (``benchmark_texts``) and the calibration split.

    A set whose data is missing is read from the reference file named by ``$HETEROSPEC_DISJOINT_REFS``
    when that file holds it; else it raises ``MissingDataError`` (its message names the fetch
    command) unless ``allow_missing``, which only logs it (the report then shows the set with 0
    references)."""
    import os

    from .. import datasets as DS

    idx = OverlapIndex()
    ref_file = os.environ.get(REFERENCES_ENV)
    stored = None
    for name in BENCHMARK_SETS:
        try:
            texts = benchmark_texts(name, gsm_n, cnndm_n)
        except DS.MissingDataError as exc:
            if ref_file:
                stored = read_reference_file(ref_file) if stored is None else stored
                if name in stored:
                    log(f"disjointness: reference set {name} read from {ref_file} ({len(stored[name])} texts)")
                    idx.add(name, stored[name])
                    continue
            if not allow_missing:
                raise
            log(f"disjointness: reference set {name} unavailable ({exc}); NOT checked")
            idx.sizes[name] += 0
            continue
        idx.add(name, texts)
    if calibration:
        from .prompts import calibration_prompts

        seen: set = set()
        for n, seed in calibration:
            texts, _ = calibration_prompts(n, seed=seed)
            idx.add("calibration", [t for t in texts if t not in seen])
            seen.update(texts)
    return idx
