"""Context lookup: draft tokens copied from the request's own context, for free.

A small target repeats itself: it copies names, numbers and code from the prompt, restates the
question, and at greedy it falls into loops. Where the last ``n`` tokens occurred before in the
prompt or the output, the tokens that followed them then are a draft that costs no draft forward
(prompt lookup decoding). How often such a chain is accepted depends on how long the match is: a
single matching token predicts little, a match of 8 tokens is a loop or a copy and its chain is
accepted almost always (bench/RESULTS.md, "Context lookup").

HeteroSpec's part is the decision, made like every other one here from measured acceptance and
measured cost: :class:`LookupGate` learns, per match-length bucket and chain position, how often a
lookup draft is accepted on this workload, prices a chain of ``k`` tokens with the device's cost
model (a verify of ``k + 1`` nodes), and runs a lookup round only when its expected tokens per
second beat what the fitted policy would do instead (a plain step or a draft tree). The chain is
verified as a tree (each node's parent is the one before), so greedy output stays the target's
and sampling keeps its law (a copied token is a deterministic proposal, accepted where it equals
the target's own keyed draw at its parent: :mod:`heterospec.sampling`).

A request also copies from the requests before it (:class:`OutputHistory`, as suffix decoding
does across requests): a small model answers like requests alike (a greeting, the steps of a
templated word problem, the opening of a code answer), so the last tokens of a request often
occurred in an earlier request's prompt or answer, and what followed them there is a chain as
free as one from its own context. The gate keeps its acceptance apart for chains of each source
(:data:`HISTORY_ROW`), so each is priced by what it delivered.

Runtime only: no tooling imports. The engine keeps one :class:`ContextIndex` per request, one
:class:`OutputHistory` and one gate per engine.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .timing import unstalled

# Longest n-gram matched, and the longest chain a lookup round verifies.
LOOKUP_NMAX = 8
LOOKUP_KMAX = 8
# Match lengths share acceptance statistics in these buckets (lower bounds): 1, 2, 3, 4-7, 8.
MATCH_BUCKETS = (1, 2, 3, 4, 8)


# The gate's rows: a context match of bucket i is row i, a history match row HISTORY_ROW + i, a
# chain from the lookup corpus (heterospec.datastore) of grade g row CORPUS_ROW + g - 1.
SOURCES = ("context", "history", "corpus")
HISTORY_ROW = len(MATCH_BUCKETS)
CORPUS_SOURCE = 2
# A request whose own context matches this many tokens or more does not ask the corpus: on the
# five benchmark sets' greedy answers the corpus's chain beat such a copy in 4-5 % of those steps
# (15 % after a one-token match, 36 % without a match), and a query is ~60 us of a 6 ms step.
CORPUS_BELOW = 3
CORPUS_ROW = CORPUS_SOURCE * len(MATCH_BUCKETS)


# The lookup prior shipped next to a lookup corpus (:func:`load_lookup_prior`): per gate row and
# chain position, lookup tokens verified and accepted on held-out prompts, for a fresh gate to
# start from (:meth:`LookupGate.seed`; measured by ``heterospec.calibrate.measure_lookup_prior``).
LOOKUP_PRIOR_FILE = "lookup_prior.json"
LOOKUP_PRIOR_FORMAT = 1


def check_lookup_prior(prior, what: str = "lookup prior") -> Tuple[List[List[float]], List[List[float]]]:
    """``(tried, hit)`` of a lookup prior (:data:`LOOKUP_PRIOR_FILE`'s content), or a ValueError
    naming what is wrong: its format, match buckets and sources must be this version's, and every
    row holds per chain position the tokens verified and, at most as many, accepted."""
    if not isinstance(prior, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(prior).__name__}")
    if prior.get("format") != LOOKUP_PRIOR_FORMAT:
        raise ValueError(f"{what}: format {prior.get('format')!r}, expected {LOOKUP_PRIOR_FORMAT}")
    if list(prior.get("buckets", ())) != list(MATCH_BUCKETS) or list(prior.get("sources", ())) != list(SOURCES):
        raise ValueError(f"{what}: match buckets {prior.get('buckets')} and sources {prior.get('sources')} "
                         f"must be {list(MATCH_BUCKETS)} and {list(SOURCES)}")
    rows = len(MATCH_BUCKETS) * len(SOURCES)
    try:
        tried = [[float(x) for x in r] for r in prior["tried"]]
        hit = [[float(x) for x in r] for r in prior["hit"]]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{what}: 'tried' and 'hit' must be lists of {rows} rows of numbers") from None
    if len(tried) != rows or len(hit) != rows or any(len(t) != len(h) or not t for t, h in zip(tried, hit)):
        raise ValueError(f"{what}: 'tried' and 'hit' must be {rows} rows of equal, non-zero lengths")
    for i, (rt, rh) in enumerate(zip(tried, hit)):
        for j, (t, h) in enumerate(zip(rt, rh)):
            if not (math.isfinite(t) and math.isfinite(h) and 0 <= h <= t):
                raise ValueError(f"{what}: row {i}, position {j}: accepted {h} of {t} verified")
    return tried, hit


def load_lookup_prior(directory: Optional[str], vocab_size: Optional[int] = None) -> Optional[dict]:
    """The lookup prior in ``directory`` (a draft's, beside its lookup corpus), or None where there
    is none, where it was measured with a target of another vocabulary, or where it cannot be read
    or is malformed (both with a warning: a damaged file costs the gate its head start, not the
    engine)."""
    if not directory:
        return None
    path = os.path.join(str(directory), LOOKUP_PRIOR_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            prior = json.load(f)
        check_lookup_prior(prior, path)
    except (OSError, ValueError) as exc:
        warnings.warn(f"{path} is not used: {exc}", stacklevel=2)
        return None
    want = prior.get("vocab_size")
    if vocab_size is not None and want is not None and int(want) != int(vocab_size):
        warnings.warn(f"{path} was measured with a vocabulary of {want} tokens, the target has {vocab_size}: "
                      f"it is not used", stacklevel=2)
        return None
    return prior


def match_bucket(n: int) -> int:
    """Index into :data:`MATCH_BUCKETS` of a match of ``n`` >= 1 tokens."""
    for i in range(len(MATCH_BUCKETS) - 1, -1, -1):
        if n >= MATCH_BUCKETS[i]:
            return i
    raise ValueError(f"match length must be >= 1, got {n}")


class ContextIndex:
    """The n-grams (n = 1..``nmax``) of one request's tokens, each mapped to the position that
    followed its latest occurrence; grown as tokens are appended (O(nmax) per token)."""

    def __init__(self, tokens: Sequence[int] = (), nmax: int = LOOKUP_NMAX) -> None:
        if nmax < 1:
            raise ValueError(f"ContextIndex: nmax must be >= 1, got {nmax}")
        self.nmax = nmax
        self.tokens: List[int] = []
        self._next: List[Dict[tuple, int]] = [dict() for _ in range(nmax + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        t = self.tokens
        for x in new:
            i = len(t)
            # The n-grams ending just before position i are now followed by a known token.
            for n in range(1, min(self.nmax, i) + 1):
                self._next[n][tuple(t[i - n:i])] = i
            t.append(int(x))

    def propose(self, k: int) -> Tuple[List[int], int]:
        """``(chain, n)``: up to ``k`` tokens that followed the latest earlier occurrence of the
        longest suffix (``n`` tokens) of the context seen before; ``([], 0)`` without one. A
        match whose continuation runs into the present is a loop and continues as one."""
        t, L = self.tokens, len(self.tokens)
        for n in range(min(self.nmax, L - 1), 0, -1):
            s = self._next[n].get(tuple(t[L - n:]))
            if s is None:
                continue
            period = L - s        # > 0: s was recorded before the last token was appended
            return [t[s + j] if s + j < L else t[s + (j - period) % period] for j in range(k)], n
        return [], 0


def proposal_row(proposal) -> int:
    """The gate's row of a proposal ``(chain, n)`` (the request's own context, ``n`` >= 1 the
    match length) or ``(chain, n, source)`` (an index into :data:`SOURCES`; ``True`` is the
    history). A corpus proposal's ``n`` is its grade, 1-5 (:meth:`heterospec.datastore.CorpusIndex.propose`:
    how far its first token is to be trusted, which says more there than the match length)."""
    source = int(proposal[2]) if len(proposal) > 2 else 0
    if source == CORPUS_SOURCE:
        return CORPUS_ROW + min(max(int(proposal[1]), 1), len(MATCH_BUCKETS)) - 1
    return match_bucket(proposal[1]) + len(MATCH_BUCKETS) * source


class OutputHistory:
    """The prompts and outputs of earlier requests (the newest ``max_tokens`` of them, whole
    requests), indexed by their n-grams (n = 1..``nmax``) like :class:`ContextIndex`: a chain
    proposed from it is what followed the latest earlier occurrence of the longest suffix of a
    request's context, and ends where that request ended.

    A request never copies from an earlier answer to its own prompt unless ``same_prompt``: a
    repeated prompt would otherwise be answered by copying, which serves a repeated request
    well but makes every comparison that runs one prompt through several methods (``heterospec
    bench``, ``generate --method all``) measure the copy. Each n-gram so remembers its latest
    occurrence and the latest one in a request with another prompt."""

    def __init__(self, max_tokens: int = 1 << 14, nmax: int = LOOKUP_NMAX, same_prompt: bool = False) -> None:
        if nmax < 1:
            raise ValueError(f"OutputHistory: nmax must be >= 1, got {nmax}")
        if max_tokens < 1:
            raise ValueError(f"OutputHistory: max_tokens must be >= 1, got {max_tokens}")
        self.nmax, self.max_tokens, self.same_prompt = nmax, max_tokens, same_prompt
        self.clear()

    def clear(self) -> None:
        self.tokens: List[int] = []
        self._segments: List[Tuple[int, int, int]] = []      # (prompt key, start, end) in tokens, oldest first
        self._last_of: Dict[int, int] = {}                    # prompt key -> hash of its latest answer
        # per n: n-gram -> (position after it, end of its request, prompt key): the latest
        # occurrence, and the latest one under another prompt key than that
        self._latest: List[Dict[tuple, Tuple[int, int, int]]] = [dict() for _ in range(self.nmax + 1)]
        self._other: List[Dict[tuple, Tuple[int, int, int]]] = [dict() for _ in range(self.nmax + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def key(prompt: Sequence[int]) -> int:
        return hash(tuple(int(t) for t in prompt))

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Remember a finished request (an answer already held for the same prompt is not
        added again: a benchmark runs each prompt once per method)."""
        k = self.key(prompt)
        seq = [int(t) for t in prompt] + [int(t) for t in output]
        h = hash(tuple(seq))
        if self._last_of.get(k) == h or len(seq) < 2:
            return
        self._last_of[k] = h
        if len(self.tokens) + len(seq) > self.max_tokens:
            # keep the newest requests within half the room (this one included), so that
            # rebuilding is rare
            keep, size = [(k, seq)], len(seq)
            for kk, s, e in reversed(self._segments):
                if size + e - s > max(self.max_tokens // 2, 1):
                    break
                keep.append((kk, self.tokens[s:e]))
                size += e - s
            last_of = {kk: self._last_of[kk] for kk, _ in keep if kk in self._last_of}
            self.clear()
            self._last_of = last_of
            for kk, sq in reversed(keep):
                self._index(kk, sq)
            return
        self._index(k, seq)

    def _index(self, k: int, seq: List[int]) -> None:
        start = len(self.tokens)
        end = start + len(seq)
        self.tokens.extend(seq)
        self._segments.append((k, start, end))
        latest, other = self._latest, self._other
        for i in range(1, len(seq)):
            entry = (start + i, end, k)
            for n in range(1, min(self.nmax, i) + 1):
                g = tuple(seq[i - n:i])
                old = latest[n].get(g)
                if old is not None and old[2] != k:
                    other[n][g] = old
                latest[n][g] = entry

    def propose(self, context: Sequence[int], k: int, prompt: Optional[Sequence[int]] = None,
                prompt_key: Optional[int] = None) -> Tuple[List[int], int]:
        """``(chain, n)``: up to ``k`` tokens that followed the latest earlier occurrence of the
        longest suffix (``n`` tokens) of ``context`` (a request's tokens so far, its prompt
        first), cut where that request ended; ``([], 0)`` without one. ``prompt`` (or its
        :meth:`key`, ``prompt_key``, computed once per request): the request's prompt, whose own
        earlier answers are skipped unless ``same_prompt``."""
        if not self.tokens or k < 1:
            return [], 0
        if prompt_key is None and prompt is not None:
            prompt_key = self.key(prompt)
        skip = None if self.same_prompt else prompt_key
        L, t = len(context), self.tokens
        for n in range(min(self.nmax, L), 0, -1):
            g = tuple(context[L - n:])
            e = self._latest[n].get(g)
            if e is not None and e[2] == skip:
                e = self._other[n].get(g)
            if e is None:
                continue
            pos, end, _ = e
            return t[pos:min(pos + k, end)], n
        return [], 0


@dataclass
class LookupRound:
    """What the gate chose for one round: per request (batch row) the chain to verify (empty:
    the request verifies its root only) and its match bucket."""

    chains: List[List[int]]
    buckets: List[int]
    predicted_ms: float          # the round's price: the cost model's, times the gate's time scale
    expected_tokens: float
    model_ms: Optional[float] = None   # the cost model's alone (None: predicted_ms)
    batch_bucket: int = 1              # the batch-size bucket it was priced at


class LookupGate:
    """When to verify a context-lookup chain instead of the policy's plan, and how long.

    Acceptance: per match bucket, source (the request's context or the history) and chain
    position ``j``, counts of lookup tokens verified at ``j`` (their predecessors accepted) and
    accepted, forgotten by ``FORGET`` in every round
    that verified the bucket, and shrunk with ``PRIOR_WEIGHT`` pseudo-observations towards
    ``PRIOR`` at ``j = 0`` and towards position ``j - 1``'s estimate after it (optimistic
    enough that every bucket is tried; a bucket that loses stops after a few rounds). Cost: the
    cost model's verify of the round's nodes times, per batch-size bucket, what lookup rounds
    measured over what the model predicted for them (a verify costs more than a plain step of
    the same rows: the tree's mask, compaction and commit), in the same milliseconds as the
    policy's plans, which carry their own measured scales."""

    PRIOR = 0.5
    PRIOR_WEIGHT = 2.0
    # A fresh gate seeded from a lookup prior (:meth:`seed`) holds, per row, this many verified
    # first tokens of evidence (later positions in the measured proportion): in use at once,
    # outweighed by a workload's own first rounds and forgotten like them, so a row the prior
    # prices low is still retried as IDLE_FORGET fades it. Rows measured on fewer than
    # PRIOR_MIN_TRIED first tokens are not seeded.
    PRIOR_EVIDENCE = 8.0
    PRIOR_MIN_TRIED = 8.0
    FORGET = 0.995
    TIME_FORGET = 0.9
    # Lookup rounds' time evidence at a batch-size bucket also fades by TIME_IDLE_FORGET at every
    # plain step timed there, and their scale is shrunk towards the plain steps' with the weight
    # of TIME_PRIOR_STEPS plain steps' predictions. Without that, a few lookup rounds timed during
    # a stall of the machine priced every later chain too high, so no chain was taken and the
    # scale was never measured again (bench/RESULTS.md, seventy-seventh session). Now a scale
    # nothing refreshes returns to the plain steps' within about a prompt.
    TIME_IDLE_FORGET = 0.93
    TIME_PRIOR_STEPS = 0.5
    # A lookup round must beat the alternative by this factor (the model's prices are estimates).
    MARGIN = 1.02
    # A bucket's counts also fade by this factor in every round in which it proposed and was not
    # verified: without it one unlucky first round (five copied tokens, none accepted) kept a
    # bucket untried for ~360 steps of a batch-8 run whose other engine's copies paid
    # (bench/RESULTS.md, thirty-eighth session). Half of a bucket's evidence is gone after ~70
    # such rounds, so a bucket that keeps losing is retried about as often.
    IDLE_FORGET = 0.99
    # A batch-size bucket whose last DECLINED_RUN choices all declined clearly (the best lookup
    # round expected below CLEAR_DECLINE of the alternative's rate) is asked every 2nd round, and
    # after every further DECLINED_RUN declines half as often, down to every SKIP_MAX-th round: a
    # choice is ~0.3 ms of Python at batch 8, 1.6 % of a plain step there, in a bucket where
    # copied chains keep losing. A near miss or a taken chain resets the bucket, so where chains
    # often come close to paying (summaries, code) the gate is asked every round; elsewhere a
    # chain that pays is taken up at most SKIP_MAX - 1 rounds late. (SKIP_MAX 4 left batch 8 at
    # 0.985x autoregressive with 205 asks for 2 lookup rounds; 32 asked 66 times for the same 2,
    # and batch 1, whose runs of declines rarely get that long, asked as often as before:
    # bench/RESULTS.md, sixty-eighth session.)
    DECLINED_RUN = 8
    SKIP_MAX = 32
    CLEAR_DECLINE = 0.8

    def __init__(self, kmax: int = LOOKUP_KMAX) -> None:
        if kmax < 1:
            raise ValueError(f"LookupGate: kmax must be >= 1, got {kmax}")
        self.kmax = kmax
        nb = len(MATCH_BUCKETS) * len(SOURCES)      # rows: match bucket x source (HISTORY_ROW)
        self._tried = [[0.0] * kmax for _ in range(nb)]
        self._hit = [[0.0] * kmax for _ in range(nb)]
        self._accept: Dict[int, List[float]] = {}    # accept(bucket), until the next observation
        # per kind and batch-size bucket: forgotten (measured, predicted) milliseconds
        self._time: Dict[str, Dict[int, List[float]]] = {"lookup": {}, "plain": {}}
        self.near_miss = False                        # the last choice declined a round close to paying
        self._declined: Dict[int, int] = {}          # per batch-size bucket: choices declined in a row
        self._asked: Dict[int, int] = {}             # ... and rounds since it declined DECLINED_RUN

    def seed(self, prior: dict) -> None:
        """Start from a lookup prior (:func:`load_lookup_prior`) instead of :data:`PRIOR` alone:
        each row measured on at least :data:`PRIOR_MIN_TRIED` first tokens takes its counts
        scaled to :data:`PRIOR_EVIDENCE` first tokens (positions past the prior's chains, or past
        ``kmax``, as before). A saved state taken up later (:meth:`load_state`) replaces it."""
        tried, hit = check_lookup_prior(prior)
        for row, (rt, rh) in enumerate(zip(tried, hit)):
            if rt[0] < self.PRIOR_MIN_TRIED:
                continue
            f = self.PRIOR_EVIDENCE / rt[0]
            n = min(len(rt), self.kmax)
            self._tried[row] = [x * f for x in rt[:n]] + [0.0] * (self.kmax - n)
            self._hit[row] = [x * f for x in rh[:n]] + [0.0] * (self.kmax - n)
        self._accept = {}

    # -- how often to ask ----------------------------------------------------------------------
    def due(self, batch_bucket: int = 1) -> bool:
        """Whether the engine asks for a lookup round this round (see ``DECLINED_RUN``)."""
        run = self._declined.get(batch_bucket, 0)
        if run < self.DECLINED_RUN:
            return True
        every = min(self.SKIP_MAX, 2 << ((run - self.DECLINED_RUN) // self.DECLINED_RUN))
        n = self._asked[batch_bucket] = self._asked.get(batch_bucket, 0) + 1
        return n % every == 0

    def answered(self, batch_bucket: int, taken: bool) -> None:
        """The outcome of a choice the engine asked for at ``batch_bucket`` (a declined one that
        was a near miss, :attr:`near_miss`, counts as taken)."""
        if taken or self.near_miss:
            self._declined[batch_bucket], self._asked[batch_bucket] = 0, 0
        else:
            self._declined[batch_bucket] = self._declined.get(batch_bucket, 0) + 1
        self.near_miss = False        # (a choice that never reached choose() was no near miss)

    # -- estimates ---------------------------------------------------------------------------
    def accept(self, bucket: int) -> List[float]:
        """Per chain position: the probability a lookup token there is accepted, its
        predecessors accepted. Position 0 is shrunk towards ``PRIOR``, every later one towards
        the estimate of the position before it: a bucket whose first tokens are accepted 90 %
        of the time is a copy or a loop, and its untried deeper positions are priced as such
        (so they are tried), not at ``PRIOR``."""
        out = self._accept.get(bucket)
        if out is None:
            w, prior, out = self.PRIOR_WEIGHT, self.PRIOR, []
            for t, h in zip(self._tried[bucket], self._hit[bucket]):
                prior = (h + w * prior) / (t + w)
                out.append(prior)
            self._accept[bucket] = out
        return out

    def expected_accepted(self, bucket: int, k: int) -> List[float]:
        """E[accepted tokens] of chains of length 0..k of this bucket."""
        out, alive, total = [0.0], 1.0, 0.0
        for p in self.accept(bucket)[:k]:
            alive *= p
            total += alive
            out.append(total)
        return out

    def time_scale(self, batch_bucket: int = 1, kind: str = "lookup") -> float:
        """At a batch-size bucket: plain steps' measured / predicted time (``kind="plain"``; 1
        before any was measured), or lookup rounds', shrunk towards the plain steps' scale with
        the weight of :data:`TIME_PRIOR_STEPS` plain steps (a lookup round before any was measured
        there is priced at the plain steps' scale: the cost model's level error)."""
        mp, pp = self._time["plain"].get(batch_bucket, (0.0, 0.0))
        plain = mp / pp if pp > 0 and mp > 0 else 1.0
        if kind != "lookup":
            return plain
        m, p = self._time["lookup"].get(batch_bucket, (0.0, 0.0))
        if not (p > 0 and m > 0):
            return plain
        # (the plain sums hold ~1 / (1 - TIME_FORGET) steps' predictions)
        w = self.TIME_PRIOR_STEPS * pp * (1.0 - self.TIME_FORGET)
        return (m + w * plain) / (p + w)

    # -- decision ----------------------------------------------------------------------------
    def better(self, own: Tuple[List[int], int], history: Tuple[List[int], int] = ([], 0),
               corpus: Optional[Tuple[List[int], int]] = None) -> tuple:
        """Of a request's proposals (its own context's, the history's and the lookup corpus's),
        the one whose chain the gate expects to deliver the most accepted tokens (in that order
        on a tie); the history's comes back as ``(chain, n, True)``, the corpus's as ``(chain,
        n, 2)``."""
        best, worth = own, self._chain_worth(own) if own[0] else -1.0
        for source, prop in ((True, history), (CORPUS_SOURCE, corpus)):
            if prop is None or not prop[0]:
                continue
            copied = (prop[0], prop[1], source)
            w = self._chain_worth(copied)
            if w > worth:
                best, worth = copied, w
        return best

    def propose(self, index: ContextIndex, k: int, history: Optional["OutputHistory"] = None,
                prompt_key: Optional[int] = None, corpus=None) -> tuple:
        """A request's proposal: its own context's chain (``index``), or the history's or the
        lookup corpus's (a :class:`heterospec.datastore.CorpusIndex`) where :meth:`better` expects
        more of it. The corpus is asked only where the own context matches fewer than
        :data:`CORPUS_BELOW` tokens. ``prompt_key``: the request's :meth:`OutputHistory.key`."""
        own = index.propose(k)
        if history is None and corpus is None:
            return own
        return self.better(own,
                           history.propose(index.tokens, k, prompt_key=prompt_key) if history is not None else ([], 0),
                           corpus.propose(index.tokens, k) if corpus is not None and own[1] < CORPUS_BELOW else None)

    def _chain_worth(self, proposal) -> float:
        """Expected accepted tokens of a proposal's chain (up to ``kmax`` of it)."""
        return self.expected_accepted(proposal_row(proposal), min(len(proposal[0]), self.kmax))[-1]

    def choose(self, proposals: Sequence[Tuple[List[int], int]], verify_ms, alternative_tokens_per_s: float,
               room: Optional[Sequence[int]] = None, batch_bucket: int = 1,
               lead: Optional[Sequence[int]] = None) -> Optional[LookupRound]:
        """A lookup round for a batch whose requests proposed ``(chain, n)`` (empty chain: no
        match; a finished request proposes nothing; ``(chain, n, True)``: a chain from the
        :class:`OutputHistory`), or None if the policy's plan is expected to
        be faster. ``verify_ms(mean_nodes, max_nodes)``: the cost model's verify of a batch whose
        requests verify those many nodes (root included), ragged or padded as the engine
        verifies; ``alternative_tokens_per_s``: the plan's predicted rate, batch tokens per
        second (or a function returning it, asked only if a chain could pay); ``room``: per
        request, tokens it may still emit (0: finished, not counted); ``batch_bucket``: the
        batch-size bucket whose time ratio prices the round.

        Every proposed token is an item worth its survival (the probability that it and the
        tokens before it in its chain are accepted), which falls along a chain. The round
        verifies the ``t`` most valuable items for the ``t`` that maximises expected tokens per
        second (ties keep chain order, so each request verifies a prefix of its chain): a
        request whose match predicts little verifies its root only, however long another
        request's chain is.

        ``lead`` (a static batch, :meth:`Engine.generate_batch`): per request, the tokens it is
        ahead of the slowest running request. Such a batch ends with its slowest request, so a
        round is worth how far it moves the slowest one (summed over the rounds that is the
        batch's length exactly; each running request's own tokens are not: a chain that moves
        one request of four moves the batch's end not at all). The round's items are then
        *levels*: level ``j`` moves the slowest request ``j`` tokens further than a plain step
        would, and needs every request less than ``j`` ahead to accept its chain's first ``j -
        lead`` tokens (a request with less room than that: all of its room, after which it has
        ended); it is worth the product of their survivals (zero where one of them has no such
        chain), times the batch size."""
        self.near_miss = False
        running = [b for b in range(len(proposals)) if room is None or room[b] > 0]
        B = len(running)
        survival, proposed = {}, set()     # per request: P(its first i + 1 chain tokens accepted)
        for b in running:
            chain, n = proposals[b][0], proposals[b][1]
            limit = min(len(chain), self.kmax, (room[b] - 1) if room is not None else self.kmax)
            if limit <= 0 or n <= 0:
                continue
            row = proposal_row(proposals[b])
            proposed.add(row)
            alive, survival[b] = 1.0, []
            for p in self.accept(row)[:limit]:
                alive *= p
                survival[b].append(alive)
        if not survival:
            return None
        # items: (worth, the requests that verify one more chain token for it)
        if lead is None:
            items = sorted(((s, (b,)) for b, ss in survival.items() for s in ss),
                           key=lambda it: -it[0])          # stable: equal worths keep chain order
        else:
            items, j, verified = [], 1, dict.fromkeys(running, 0)
            while True:
                worth, group = float(B), []
                for b in running:
                    # the tokens b must accept for level j; a request that ends in this round
                    # (all its room accepted) no longer holds the batch
                    need = min(j - lead[b], room[b] - 1) if room is not None else j - lead[b]
                    if need <= 0:
                        continue
                    ss = survival.get(b, ())
                    worth *= ss[need - 1] if need <= len(ss) else 0.0
                    if need > verified[b]:
                        verified[b] = need
                        group.append(b)
                if worth <= 0.0 or not group:
                    break
                items.append((worth, tuple(group)))
                j += 1
        ratio = self.time_scale(batch_bucket)
        ks = dict.fromkeys(running, 0)
        tokens, longest, t = float(B), 0, 0        # a plain step: one token for each request
        prev = verify_ms(1.0, 1)
        best = (1e3 * tokens / (prev * ratio), dict(ks), None, tokens)    # roots only
        for value, group in items:
            for b in group:
                ks[b] += 1
                longest = max(longest, ks[b])
            t += len(group)
            tokens += value
            model = verify_ms(1.0 + t / B, 1 + longest)
            rate = 1e3 * tokens / (model * ratio)
            if rate > best[0]:
                best = (rate, dict(ks), model, tokens)
            elif t > len(group) and 1e3 * value / (max(model - prev, 1e-9) * ratio) < best[0]:
                break        # worths fall and rows do not get cheaper: no later item pays either
            prev = model
        rate, ks, model, tokens = best
        if model is None:
            self._fade(proposed)
            return None            # not even a chain of one token pays for its row
        if callable(alternative_tokens_per_s):
            alternative_tokens_per_s = alternative_tokens_per_s()
        if rate < self.MARGIN * alternative_tokens_per_s:
            self.near_miss = rate >= self.CLEAR_DECLINE * alternative_tokens_per_s
            self._fade(proposed)
            return None
        chains = [proposals[b][0][:ks.get(b, 0)] for b in range(len(proposals))]
        buckets = [proposal_row(proposals[b]) if ks.get(b, 0) > 0 else -1 for b in range(len(proposals))]
        self._fade(proposed - set(buckets))
        return LookupRound(chains, buckets, model * ratio, tokens, model, batch_bucket)

    def holds_batch(self, proposal, lead: int, room: int) -> bool:
        """Whether, in a static batch (:meth:`choose` with ``lead``), this request's proposal
        makes every lookup round worthless: it is among the slowest requests, has no chain and
        does not end with this round's bonus. The engine then asks no other request."""
        return lead == 0 and room > 1 and not proposal[0]

    def _fade(self, buckets) -> None:
        """``IDLE_FORGET`` on the counts of match buckets that proposed and were not verified."""
        for row in buckets:
            self._tried[row] = [x * self.IDLE_FORGET for x in self._tried[row]]
            self._hit[row] = [x * self.IDLE_FORGET for x in self._hit[row]]
            self._accept.pop(row, None)

    # -- learning ----------------------------------------------------------------------------
    def observe(self, chosen: LookupRound, accept_lens: Sequence[int], seconds: Optional[float]) -> None:
        """What the target accepted of each request's chain, and the round's wall time."""
        f = self.FORGET
        for row in {bk for bk, c in zip(chosen.buckets, chosen.chains) if bk >= 0 and c}:
            # (per bucket: a match length this workload rarely meets keeps what it showed)
            self._tried[row] = [x * f for x in self._tried[row]]
            self._hit[row] = [x * f for x in self._hit[row]]
        self._accept = {}
        for chain, bucket, a in zip(chosen.chains, chosen.buckets, accept_lens):
            if bucket < 0 or not chain:
                continue
            for j in range(min(int(a) + 1, len(chain))):
                self._tried[bucket][j] += 1.0
                self._hit[bucket][j] += 1.0 if j < a else 0.0
        model = chosen.predicted_ms if chosen.model_ms is None else chosen.model_ms
        if seconds is not None and model > 0 and math.isfinite(seconds):
            self._add_time("lookup", chosen.batch_bucket, 1e3 * seconds, model)

    def observe_plain(self, seconds: Optional[float], predicted_ms: float, batch_bucket: int = 1) -> None:
        """A plain step's wall time against the cost model's prediction for it."""
        if seconds is not None and predicted_ms > 0 and math.isfinite(seconds):
            self._add_time("plain", batch_bucket, 1e3 * seconds, predicted_ms)
            lookup = self._time["lookup"].get(batch_bucket)
            if lookup is not None:                  # (TIME_IDLE_FORGET)
                self._time["lookup"][batch_bucket] = [x * self.TIME_IDLE_FORGET for x in lookup]

    # -- between processes -------------------------------------------------------------------
    def state(self) -> dict:
        return {"kmax": self.kmax, "buckets": list(MATCH_BUCKETS), "sources": list(SOURCES),
                "tried": self._tried, "hit": self._hit, "time": self._time}

    def load_state(self, state: dict) -> bool:
        """Take up a saved :meth:`state` (what an earlier process learned on this device); a state
        of another shape is ignored (one from before a source existed takes the prior on its rows).
        Returns whether it was taken."""
        try:
            tried = [[float(x) for x in row] for row in state["tried"]]
            hit = [[float(x) for x in row] for row in state["hit"]]
            # a state from before a source existed takes the prior on that source's rows
            saved = list(state.get("sources", SOURCES[:len(tried) // len(MATCH_BUCKETS)]))
            same_rows = len(tried) == len(hit) == len(MATCH_BUCKETS) * len(saved)
            if same_rows and saved == list(SOURCES[:len(saved)]):
                missing = len(MATCH_BUCKETS) * (len(SOURCES) - len(saved))
                tried += [[0.0] * self.kmax for _ in range(missing)]
                hit += [[0.0] * self.kmax for _ in range(missing)]
            rows = len(MATCH_BUCKETS) * len(SOURCES)
            time_ = {k: {int(b): [float(x) for x in v] for b, v in state["time"][k].items()}
                     for k in ("lookup", "plain")}
            ok = (int(state["kmax"]) == self.kmax and list(state["buckets"]) == list(MATCH_BUCKETS)
                  and same_rows and list(SOURCES[:len(saved)]) == saved
                  and all(len(r) == self.kmax for r in tried + hit) and len(tried) == len(hit) == rows
                  and all(len(v) == 2 and min(v) >= 0 for per in time_.values() for v in per.values())
                  and all(0 <= h <= t + 1e-9 for rt, rh in zip(tried, hit) for t, h in zip(rt, rh)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        if ok:
            self._tried, self._hit, self._time, self._accept = tried, hit, time_, {}
        return ok

    def load(self, path: str) -> bool:
        """:meth:`load_state` from the JSON file at ``path``; a missing or unreadable file is ignored."""
        try:
            with open(path) as f:
                return self.load_state(json.load(f))
        except (OSError, ValueError):
            return False

    def save(self, path: str) -> None:
        """Write :meth:`state` to ``path``; a failed write is not an error (the next process learns again)."""
        from ._io import write_json_atomic
        try:
            write_json_atomic(path, self.state())
        except OSError:
            pass

    def _add_time(self, kind: str, batch_bucket: int, measured_ms: float, predicted_ms: float) -> None:
        m, p = self._time[kind].get(batch_bucket, (0.0, 0.0))
        f = self.TIME_FORGET
        # a stall counts as STALL_FACTOR times the prediction (times the scale measured so far)
        measured_ms = unstalled(measured_ms, predicted_ms * max(1.0, m / p if p > 0 and m > 0 else 1.0))
        self._time[kind][batch_bucket] = [m * f + measured_ms, p * f + predicted_ms]
