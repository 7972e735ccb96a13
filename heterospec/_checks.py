"""Cheap Python-side argument checks for the op wrappers (dtype, rank, device, sizes).

They only look at metadata, so they work on fake tensors under ``torch.compile`` and never
synchronise with a device. Every failure is a ``ValueError`` worded like the C++ checks:
``"select_tree_nodes: expected parents of dtype torch.int64, got torch.int32"``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

DTypes = Union[torch.dtype, Sequence[torch.dtype]]

FLOAT_LOGITS = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_tensor(
    op: str,
    name: str,
    x: object,
    *,
    dtype: Optional[DTypes] = None,
    ndim: Optional[int] = None,
    layout: str = "",
    device: Optional[torch.device] = None,
    device_of: str = "",
) -> torch.Tensor:
    """Validate one tensor argument of ``op`` and return it.

    Parameters
    ----------
    op, name:
        Op and argument names used in the message.
    dtype:
        Allowed dtype(s).
    ndim, layout:
        Expected rank, and a shape description for the message (``"[B, T]"``).
    device, device_of:
        Expected device and the name of the argument it comes from.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{op}: expected {name} to be a torch.Tensor, got {type(x).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if x.dtype not in allowed:
            raise ValueError(f"{op}: expected {name} of dtype {_dtype_names(allowed)}, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(
            f"{op}: expected {name} to have {ndim} dimensions {layout}, got {x.dim()} dimensions "
            f"with shape {list(x.shape)}".replace("  ", " ")
        )
    if device is not None and x.device != device:
        raise ValueError(f"{op}: expected {name} on device {device} (the device of {device_of}), got {x.device}")
    return x


def check_size(op: str, name: str, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """``x.size(dim)`` must equal ``expected``; ``what`` says where the expectation comes from.

    Sizes may be symbolic under ``torch.compile``; those are left to the op itself.
    """
    got = x.size(dim)
    if isinstance(got, int) and isinstance(expected, int) and got != expected:
        raise ValueError(
            f"{op}: expected {name}.size({dim}) == {expected} ({what}), got {got} "
            f"({name} has shape {list(x.shape)})"
        )


def check_int(op: str, name: str, value: object, *, minimum: Optional[int] = None) -> int:
    """A Python int argument (bools rejected), optionally bounded below."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise ValueError(f"{op}: expected {name} to be an int, got {type(value).__name__}")
    if minimum is not None and isinstance(value, int) and value < minimum:
        raise ValueError(f"{op}: expected {name} >= {minimum}, got {value}")
    return value  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Sync-free regions
# ---------------------------------------------------------------------------------------------
_SYNC_FREE = [0]


def usable_device(device, owner: str = "", unavailable_hint: str = "") -> torch.device:
    """``device`` parsed, where this process can run: the CPU, or a CUDA device this torch build
    can see. Anything else is a ``ValueError`` that says why (prefixed ``owner: ``; a CUDA device
    that cannot be used ends with ``unavailable_hint``), not torch's list of every device type or
    an assertion inside it. The CLI's ``--device`` reports the same reasons as usage errors."""
    at = f"{owner}: " if owner else ""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{at}unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"{at}unsupported device {device!r}; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"{at}{device!r} requested but {why}{unavailable_hint}")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{at}{device!r} requested but only {count} CUDA device(s) are visible{unavailable_hint}")
    return dev


class sync_free:
    """Inside this context the models skip their host-side validation reads (KV-cache bounds,
    tree slots, the CPU attention width): a capture-ready round, whose shapes and bounds the
    engine fixed when it allocated the caches, reads the device only where it chooses to."""

    def __enter__(self):
        _SYNC_FREE[0] += 1
        return self

    def __exit__(self, *exc):
        _SYNC_FREE[0] -= 1
        return False


def host_reads_allowed(t: torch.Tensor) -> bool:
    """Whether a validation check may read ``t`` on the host: not inside :class:`sync_free`, and
    not while a CUDA graph is being captured."""
    if _SYNC_FREE[0]:
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())
