"""Lint of the op library: schemas, mutation annotations, fakes, CPU kernels, documentation."""

import inspect
import pathlib
import re

import pytest
import torch

import heterospec
import heterospec.ops as ops

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _schemas():
    return {s.name.split("::")[1]: s for s in torch._C._jit_get_all_schemas() if s.name.startswith("heterospec::")}


def test_op_set_matches_design():
    assert set(_schemas()) == set(ops.OP_NAMES)
    names = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("heterospec::")}
    assert names == set(ops.OP_NAMES)


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_schema_arg_names_unique_and_snake_case(name):
    s = _schemas()[name]
    args = [a.name for a in s.arguments]
    rets = [r.name for r in s.returns if r.name]
    assert len(set(args)) == len(args), f"duplicate argument name in {s}"
    assert len(set(args + rets)) == len(args + rets), f"a return shares a name with an argument in {s}"
    for n in args + rets:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", n), f"{name}: {n!r} is not snake_case"


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_written_args_annotated(name):
    """In-place ops end in `_`, annotate each written tensor (a!), (b!)... with distinct sets, and
    return nothing; functional ops write nothing."""
    s = _schemas()[name]
    written = [a for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
    if name.endswith("_"):
        assert written, f"{name} is in place but annotates no written argument"
        sets = [tuple(sorted(a.alias_info.before_set)) for a in written]
        assert len(set(sets)) == len(sets), f"{name}: written arguments share an alias set"
        assert len(s.returns) == 0
    else:
        assert not written, f"{name} writes {[a.name for a in written]} but is not named with a trailing _"
    for a in s.arguments:
        if a.alias_info is not None:
            assert a.alias_info.is_write, f"{name}: {a.name} has a read-only alias annotation"


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_fake_and_cpu_kernel_registered(name):
    q = f"heterospec::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(q, "CPU"), f"no CPU kernel for {q}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(q, "Meta"), f"no fake (register_fake) for {q}"


def test_fakes_run_on_meta_tensors():
    from test_ops_opcheck import samples

    for name, args in samples("cpu"):
        meta = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
        out = getattr(torch.ops.heterospec, name).default(*meta)
        real = getattr(torch.ops.heterospec, name).default(*[a.clone() if isinstance(a, torch.Tensor) else a
                                                             for a in args])
        flat = out if isinstance(out, tuple) else (out,) if out is not None else ()
        flat_real = real if isinstance(real, tuple) else (real,) if real is not None else ()
        assert len(flat) == len(flat_real)
        for m, r in zip(flat, flat_real):
            assert m.shape == r.shape and m.dtype == r.dtype, (name, m.shape, r.shape, m.dtype, r.dtype)


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_wrapper_documented(name):
    fn = getattr(ops, name)
    doc = inspect.getdoc(fn) or ""
    assert "Parameters" in doc, f"ops.{name} has no numpy-style Parameters section"
    if not name.endswith("_"):          # in-place ops return nothing
        assert "Returns" in doc, f"ops.{name} has no Returns section"
    for p in inspect.signature(fn).parameters:
        assert p in doc, f"ops.{name}: parameter {p!r} is not documented"
    assert getattr(heterospec, name) is fn, f"heterospec.{name} is not exported"


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_op_in_op_reference(name):
    text = (ROOT / "docs" / "ops.md").read_text()
    assert re.search(rf"^#+ .*`{re.escape(name)}\b", text, re.M), f"docs/ops.md has no section for {name}"


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_op_in_readme(name):
    """README.md's op table has a row for every op, with the registered schema, and links the
    full reference (docs/ops.md)."""
    text = (ROOT / "README.md").read_text()
    assert "](docs/ops.md)" in text, "README.md does not link docs/ops.md"
    schema = str(_schemas()[name]).split("::", 1)[1]
    assert schema.startswith(name + "(")
    row = re.search(rf"^\| `{re.escape(name)}` \| `(.*)` \|$", text, re.M)
    assert row, f"README.md's op table has no row for {name}"
    assert row.group(1) == schema[len(name):], f"README.md's schema for {name} differs from the registered one"


def test_op_reference_up_to_date():
    import runpy

    gen = runpy.run_path(str(ROOT / "docs" / "gen_ops_md.py"))
    expected = gen["render"]()
    assert (ROOT / "docs" / "ops.md").read_text() == expected, "docs/ops.md is stale: run python docs/gen_ops_md.py"
