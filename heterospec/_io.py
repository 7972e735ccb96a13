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
