"""Regenerate docs/ops.md (the op reference) from the wrappers' docstrings and the C++ schemas.

    python docs/gen_ops_md.py

tests/test_schemas.py fails when docs/ops.md is out of date.
"""

import inspect
import pathlib
import re

import torch

import heterospec.ops as ops

OUT = pathlib.Path(__file__).resolve().parent / "ops.md"

INTRO = """\
# heterospec op reference

The operators registered under `torch.ops.heterospec` (schemas in `csrc/ops.cpp`; contracts in
[design.md](design.md), the single source of truth), with their Python wrappers in
`heterospec.ops` (also exported from `heterospec`). This page is generated from the wrappers'
docstrings by `python docs/gen_ops_md.py`; `tests/test_schemas.py` fails when it is stale.

Call the wrappers: they check dtypes, ranks and devices up front, the kernels check values.
Every failure is a `ValueError` that names the op, the tensor and what was expected versus
what was received (for example `select_tree_nodes: expected parents of dtype torch.int64, got
torch.int32`).

Conventions: `B` requests per batch; tree capacity `T` (position 0 = the root, the last sampled
token, not yet in the target's KV cache; nodes are topologically ordered, parents first); index
tensors are `int64` with `-1` as the "none / padding" sentinel; `L_b = prefix_lens[b]` tokens
are committed to the target's KV cache. Every op has a fake kernel (so
`torch.compile(fullgraph=True)` traces it) and passes `torch.library.opcheck`.

On CUDA no op synchronises with the host: metadata errors raise up front, but bad *values* (which
the CPU kernels raise on) are flagged in the outputs instead. The contract for the two ops whose
flags matter at run time (`topk_entropy`: an invalid logits row; `verify_sampling`: a target row
that is not a distribution) is in their Notes, and the [error helpers](#cuda-error-flags) turn
the flags into the CPU ops' `ValueError`s in one host read (the engine folds them into its
round's single device-to-host copy).
"""

HELPERS_INTRO = """\
## CUDA error flags

Functions of `heterospec.ops` (not ops): the `*_invalid` ones compute a flag tensor on the device
without a host sync; the `raise_*` ones take that tensor (one host read) or its host values and
raise the CPU op's `ValueError`.
"""


def _md(doc: str) -> str:
    lines, res, i = doc.split("\n"), [], 0
    while i < len(lines):
        if i + 1 < len(lines) and re.fullmatch(r"-{3,}", lines[i + 1].strip()):
            res += [f"**{lines[i].strip()}**", ""]  # numpy section header
            i += 2
            continue
        res.append(lines[i])
        i += 1
    text = "\n".join(res).replace("``", "`")
    text = re.sub(r"^(\w[\w, ]*) : (.+)$", r"- `\1` (\2):", text, flags=re.M)
    text = re.sub(r"^(ValueError)$", r"- `\1`:", text, flags=re.M)
    text = re.sub(r"^    ", "  ", text, flags=re.M)
    return re.sub(r":func:`(\w+)`", r"`\1`", text)


def _sig(fn) -> str:
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(parts)


def render() -> str:
    schemas = {s.name.split("::")[1]: s for s in torch._C._jit_get_all_schemas() if s.name.startswith("heterospec::")}
    out = [INTRO, "| op | purpose |", "|---|---|"]
    for n in ops.OP_NAMES:
        first = inspect.getdoc(getattr(ops, n)).split("\n")[0].replace("``", "`")
        out.append(f"| [`{n}`](#{n}) | {first} |")
    out.append("")
    for n in ops.OP_NAMES:
        fn = getattr(ops, n)
        schema = str(schemas[n])
        if not schema.startswith("heterospec::"):
            schema = "heterospec::" + schema
        out += [f"## `{n}`", "", "```", schema, "```", "", f"Python: `heterospec.{n}({_sig(fn)})`", "",
                _md(inspect.getdoc(fn)), ""]
    out += [HELPERS_INTRO]
    for n in ops.ERROR_HELPERS:
        fn = getattr(ops, n)
        out += [f"### `{n}`", "", f"Python: `heterospec.ops.{n}({_sig(fn)})`", "", _md(inspect.getdoc(fn)), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
