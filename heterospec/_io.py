"""Small file helpers shared by the runtime modules."""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Callable, Dict, Optional


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in ``path``; a file that is not one is a ``ValueError`` naming it and
    ``what`` it is (e.g. "target config"), not a bare ``JSONDecodeError``."""
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} {path} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {path} must hold a JSON object, got {type(obj).__name__}")
    return obj


def write_json_atomic(path: str, obj, indent: Optional[int] = None) -> None:
    """Write ``obj`` as JSON to ``path`` (its directory created if missing) through a temporary
    file and a rename: a reader never sees half a file, and a failed write leaves neither a half
    file nor a stray temporary."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# What an engine learned (the fitted policy's online state, the lookup gate's) is written at most
# once per SAVE_EVERY_S seconds per file: each write is milliseconds of JSON, a visible share of a
# short call on a slow core (bench/RESULTS.md, seventy-third session), and the next process needs
# only the newest state: the next due write, or the one held back, written at exit.
SAVE_EVERY_S = 10.0
_saves_lock = threading.Lock()
_last_save: Dict[str, float] = {}
_held_saves: Dict[str, Callable[[], None]] = {}


def save_throttled(path: str, save: Callable[[], None], every_s: Optional[float] = None) -> bool:
    """Run ``save`` (which writes ``path``) now if this process last wrote ``path`` at least
    ``every_s`` (default :data:`SAVE_EVERY_S`) seconds ago or never; else hold it as the path's
    pending save (replacing an older one), run by :func:`flush_saves` at the interpreter's exit.
    Returns whether it wrote now."""
    every = SAVE_EVERY_S if every_s is None else every_s
    now = time.monotonic()
    with _saves_lock:
        last = _last_save.get(path)
        if last is not None and now - last < every:
            _held_saves[path] = save
            return False
        _last_save[path] = now
        _held_saves.pop(path, None)
    save()
    return True


@atexit.register
def flush_saves() -> None:
    """Run every save :func:`save_throttled` held back (at exit; callable any time), except into
    a directory removed since (a test's temporary one)."""
    with _saves_lock:
        held = list(_held_saves.items())
        _held_saves.clear()
        now = time.monotonic()
        for path, _ in held:
            _last_save[path] = now
    for path, save in held:
        if os.path.isdir(os.path.dirname(os.path.abspath(path))):   # (not into a removed directory)
            save()


def tree_file(filename: str, tag: str) -> str:
    """``<stem>_<tag>.json`` for ``<stem>.json``: a calibration file for one tree (``tag`` e.g.
    ``k10`` or ``d7_k10``) next to the draft, beside the historical ``<stem>.json``."""
    stem, ext = os.path.splitext(filename)
    return f"{stem}_{tag}{ext}"


def find_tree_file(directory: Optional[str], filename: str, tag: Optional[str]) -> Optional[str]:
    """The calibration file for a tree: its tagged name when present, else ``filename`` (whatever
    tree it holds: the caller compares), else None."""
    if not directory:
        return None
    for name in ([tree_file(filename, tag)] if tag else []) + [filename]:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    return None


def tree_file_to_write(directory: str, filename: str, tag: str, same_tree) -> str:
    """Where a calibration for a tree goes: ``filename`` when the directory has none yet or holds
    this tree's (``same_tree(its parsed JSON)``), so a draft's first calibration keeps the
    historical name; the tagged name otherwise, so that calibrating a second tree (the GPU's
    (10, 7, 60) next to the CPU's (4, 3, 8)) never replaces the first."""
    plain = os.path.join(directory, filename)
    if os.path.exists(plain):
        try:
            with open(plain) as f:
                same = bool(same_tree(json.load(f)))
        except (OSError, ValueError, TypeError, AttributeError):
            same = False
        if not same:
            return os.path.join(directory, tree_file(filename, tag))
    return plain
