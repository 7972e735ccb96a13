"""Small file helpers shared by the runtime modules."""

from __future__ import annotations

import json
import os
from typing import Optional


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
