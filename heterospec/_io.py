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


def tree_file(base: str, tag: str) -> str:
    """``<base>_<tag>.json``: a calibration file for one tree (``tag`` e.g. ``k10`` or ``d7_k10``)
    next to the draft, beside the historical ``<base>.json``."""
    return f"{base}_{tag}.json"


def find_tree_file(directory: Optional[str], base: str, tag: Optional[str]) -> Optional[str]:
    """The calibration file for a tree: ``<base>_<tag>.json`` when present, else ``<base>.json``
    (whatever tree it holds: the caller compares), else None."""
    if not directory:
        return None
    for name in ([tree_file(base, tag)] if tag else []) + [f"{base}.json"]:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    return None


def tree_file_to_write(directory: str, base: str, tag: str, same_tree) -> str:
    """Where a calibration for a tree goes: ``<base>.json`` when the directory has none yet or
    holds this tree's (``same_tree(path)``), so a draft's first calibration keeps the historical
    name; ``<base>_<tag>.json`` otherwise, so that calibrating a second tree (the GPU's
    (10, 7, 60) next to the CPU's (4, 3, 8)) never replaces the first."""
    plain = os.path.join(directory, f"{base}.json")
    if not os.path.exists(plain) or same_tree(plain):
        return plain
    return os.path.join(directory, tree_file(base, tag))
