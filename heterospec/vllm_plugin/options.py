"""What the user asked of HeteroSpec in vLLM, and the draft's chain tables (no vLLM import here)."""

from __future__ import annotations

import os
from typing import Optional

from ..policy import CHAIN_TABLES_FILENAME, AcceptanceTables

CONFIG_KEY = "heterospec"
OPTIONS = ("tables", "costs", "learn", "path_stop", "lean_steps", "lookup", "history", "corpus", "draft_stream")
COSTS_DIR = "vllm-costs"


class HeteroSpecSetupError(ValueError):
    """HeteroSpec cannot run with this vLLM configuration (the message says why)."""


def requested(vllm_config) -> Optional[dict]:
    """The user's HeteroSpec options (``additional_config["heterospec"]``), or None when
    HeteroSpec was not asked for."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or CONFIG_KEY not in extra:
        return None
    options = extra[CONFIG_KEY]
    if options is None or options is True:
        return {}
    if not isinstance(options, dict):
        raise HeteroSpecSetupError(f"additional_config['{CONFIG_KEY}'] must be a dict of options, got {options!r}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise HeteroSpecSetupError(f"additional_config['{CONFIG_KEY}']: unknown option(s) {unknown}; "
                                   f"known: {list(OPTIONS)}")
    for key in ("learn", "path_stop", "lean_steps", "lookup", "history", "corpus", "draft_stream"):
        if key in options and not isinstance(options[key], bool):
            raise HeteroSpecSetupError(f"additional_config['{CONFIG_KEY}']['{key}'] must be true or false, "
                                       f"got {options[key]!r}")
    for key in ("tables", "costs"):
        if key in options and not isinstance(options[key], str):
            raise HeteroSpecSetupError(f"additional_config['{CONFIG_KEY}']['{key}'] must be a path, "
                                       f"got {options[key]!r}")
    return dict(options)


def default_costs_path(vllm_config) -> str:
    """Where the step-cost model of this device + model pair + vLLM setup is kept between
    processes (``~/.cache/heterospec/vllm-costs/<hash>.json``)."""
    import hashlib
    import json

    from ..costmodel import _cpu_info
    from ..fetch import cache_root

    import torch
    spec = vllm_config.speculative_config
    par = vllm_config.parallel_config
    key = {"cpu": _cpu_info(), "threads": torch.get_num_threads(),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "target": os.path.abspath(str(vllm_config.model_config.model)), "dtype": str(vllm_config.model_config.dtype),
           "draft": os.path.abspath(str(spec.model)) if spec is not None else None,
           "k": getattr(spec, "num_speculative_tokens", None),
           "tp": getattr(par, "tensor_parallel_size", 1), "pp": getattr(par, "pipeline_parallel_size", 1)}
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(str(cache_root()), COSTS_DIR, f"{h}.json")


def load_chain_tables(draft_dir: Optional[str], options: dict) -> AcceptanceTables:
    """The draft's chain acceptance tables, keeping the binning options read after the first draft
    forward (the only point where vLLM's proposer can still choose how many forwards follow)."""
    if not draft_dir or not os.path.isdir(draft_dir):
        raise HeteroSpecSetupError(f"HeteroSpec: the EAGLE-3 draft directory {draft_dir!r} does not exist "
                                   "(speculative_config['model'])")
    path = options.get("tables") or os.path.join(draft_dir, CHAIN_TABLES_FILENAME)
    if not os.path.exists(path):
        raise HeteroSpecSetupError(
            f"HeteroSpec: no chain acceptance tables at {path}. Make them for this target + draft with "
            f"`heterospec calibrate --chain --target TARGET_DIR --draft {draft_dir}` (or pass "
            "additional_config={'heterospec': {'tables': PATH}})")
    tables = AcceptanceTables.load(path)
    if tables.top_k != 1:
        raise HeteroSpecSetupError(f"HeteroSpec: {path} holds tree tables (top_k {tables.top_k}); vLLM drafts "
                                   "chains and needs chain tables (`heterospec calibrate --chain`)")
    first = [o for o in tables.options if o.decide_depth == 0]
    if not first:
        raise HeteroSpecSetupError(f"HeteroSpec: {path} has no binning option read after the first draft forward")
    return AcceptanceTables(tables.top_k, tables.depths, tables.nodes, first, tables.provenance, tables.held_out)
