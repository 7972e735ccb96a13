"""Static per-request KV cache: K and V as [num_layers, B, S_max, H_kv, D] ("NHD" per request).

Slot `s` of request `b` holds the K/V of absolute position `s`. Rows are written at
`prefix_lens[b] + j`; `compact` moves accepted tree rows down after verification.
"""

from __future__ import annotations

import math

import torch

from .. import ops


def _host_checks_enabled(t: torch.Tensor) -> bool:
    # Host-side validation reads tensors (a sync on CUDA); skip it while capturing a CUDA graph
    # and inside a sync-free round (heterospec._checks.sync_free).
    from .._checks import host_reads_allowed
    return host_reads_allowed(t)


class KVCache:
    """k, v: [num_layers, B, S_max, H_kv, D], zero-initialised, contiguous."""

    def __init__(self, num_layers: int, batch_size: int, max_length: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"KVCache needs batch_size >= 1 and max_length >= 1, got {batch_size}, {max_length}")
        shape = (num_layers, batch_size, max_length, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    def check_prefix_lens(self, prefix_lens: torch.Tensor) -> None:
        if prefix_lens.shape != (self.batch_size,):
            raise ValueError(f"prefix_lens must have shape [{self.batch_size}], got {list(prefix_lens.shape)}")

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, prefix_lens: torch.Tensor,
              num_valid: torch.Tensor | None = None, host_lens: list[int] | None = None) -> None:
        """Write k_new, v_new [B, T, H_kv, D] at slots prefix_lens[b] + j.

        num_valid [B] (optional): only rows j < num_valid[b] are written; the others leave the cache
        untouched (and may lie past S_max). Writing a row past S_max is an error.
        host_lens (optional): ``prefix_lens.tolist()``, read once by a caller that writes every
        layer (a host read per layer costs about as much as the copy).
        """
        B, T = k_new.shape[:2]
        S = self.max_length
        kc, vc = self.k[layer], self.v[layer]  # [B, S, H, D]
        if (num_valid is None and B <= 4 and not k_new.is_cuda and k_new.dtype == kc.dtype == v_new.dtype
                and _host_checks_enabled(prefix_lens)):
            # CPU, a few requests: each request's rows are one contiguous run of slots, so copy
            # slices. The indexed write below costs several times one slice copy per call (a
            # forward makes two per layer); from about 4 requests on it is the cheaper one.
            starts = prefix_lens.tolist() if host_lens is None else host_lens
            if all(0 <= p and p + T <= S for p in starts):
                for b, p in enumerate(starts):
                    kc[b, p:p + T].copy_(k_new[b])
                    vc[b, p:p + T].copy_(v_new[b])
                return
        j = torch.arange(T, device=k_new.device)
        slots = prefix_lens[:, None] + j  # [B, T]
        b_idx = torch.arange(B, device=k_new.device)[:, None].expand(B, T)
        if num_valid is None:
            kc[b_idx, slots] = k_new
            vc[b_idx, slots] = v_new
            return
        # Padding rows re-write the value already in the cache (a no-op) at their own slot, or at
        # slot 0 when theirs is past S_max. Slot 0 is only a real write when prefix_lens[b] == 0,
        # and then no padding row of b is out of range (T <= S is checked by the caller).
        valid = j < num_valid[:, None]
        slots = torch.where(valid | (slots < S), slots, torch.zeros_like(slots))
        keep = valid[..., None, None]
        kc[b_idx, slots] = torch.where(keep, k_new, kc[b_idx, slots])
        vc[b_idx, slots] = torch.where(keep, v_new, vc[b_idx, slots])

    def check_fits(self, prefix_lens: torch.Tensor, n: int | torch.Tensor, what: str = "write") -> None:
        """Raise if prefix_lens[b] + n (n: int or [B]) exceeds max_length (host check)."""
        self.check_prefix_lens(prefix_lens)
        if not _host_checks_enabled(prefix_lens):
            return
        # one host read of the lengths (a copy of B ints), the checks in Python: three tensor ops
        # and two reads were ~40 us of every CPU forward (bench/RESULTS.md, sixty-third session)
        lens = prefix_lens.tolist()
        if min(lens) < 0:
            raise ValueError(f"{what}: prefix_lens must be >= 0, got {lens}")
        worst = max(lens) + n if isinstance(n, int) else int((prefix_lens + n).max())
        if worst > self.max_length:
            raise ValueError(
                f"{what}: writing past the KV cache (needs {worst} slots, max_length is {self.max_length}); "
                f"allocate a larger cache"
            )

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the requests ``rows`` (int64 [B'], in the new order): the others' slots are
        freed. A copy of the kept rows; the engine drops finished requests with it, so that a
        batch's later rounds cost what the requests still running need."""
        if rows.dim() != 1 or rows.numel() < 1:
            raise ValueError(f"keep_rows needs a non-empty 1-D index of requests, got shape {list(rows.shape)}")
        if rows.dtype != torch.int64 or rows.device != self.k.device:
            raise ValueError(f"keep_rows needs int64 rows on {self.k.device}, got {rows.dtype} on {rows.device}")
        lo, hi = int(rows.min()), int(rows.max())        # (a host read: compaction is rare)
        if lo < 0 or hi >= self.batch_size:
            raise ValueError(f"keep_rows: rows must be in [0, {self.batch_size}), got {rows.tolist()}")
        if self.k.device.type == "cpu" and rows.numel() <= self.batch_size and self.k.is_contiguous():
            self.k, self.v = _keep_rows_in_place(self.k, rows), _keep_rows_in_place(self.v, rows)
        else:
            self.k = self.k.index_select(1, rows)
            self.v = self.v.index_select(1, rows)

    def compact(self, accept_path: torch.Tensor, accept_len: torch.Tensor, prefix_lens: torch.Tensor) -> None:
        """cache[l, b, L_b + i] = cache[l, b, L_b + accept_path[b, i]] for i in [0, accept_len[b]]."""
        ops.compact_kv_(self.k, self.v, accept_path, accept_len, prefix_lens)


def _keep_rows_in_place(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t.index_select(1, rows)`` (contiguous ``[L, B, ...]`` -> ``[L, B', ...]``, B' <= B) written
    into ``t``'s own storage, as a contiguous tensor at its start. On a CPU a new cache-sized
    tensor is fresh pages, and faulting them in made a batch's compaction take several times a
    copy's time, and vary with the allocator's state (bench/RESULTS.md, fifty-first session).

    Layer by layer through a one-layer buffer: layer l of the result ends at (l + 1) * B' rows,
    before layer l + 1 of ``t`` starts at (l + 1) * B rows, and it is written only after layer l
    of ``t`` was read, so no row is overwritten before it is read (any order of ``rows``)."""
    shape = (t.shape[0], rows.numel()) + tuple(t.shape[2:])
    out = t.view(-1)[:math.prod(shape)].view(shape)         # the storage's first L * B' rows
    buf = t.new_empty(out.shape[1:])
    for layer in range(t.shape[0]):
        torch.index_select(t[layer], 0, rows, out=buf)
        out[layer].copy_(buf)
    return out
