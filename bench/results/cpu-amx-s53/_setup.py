"""What the 52nd session's scripts share (run as `python bench/results/cpu-amx-s52/NAME.py`, so
this directory is on sys.path): the built-in pair on the CPU in a dtype, and the prompts they
call with (MT-bench and Alpaca, 16 each, seed 0) as texts."""
import warnings

import torch

from heterospec import Engine
from heterospec.bench import load_prompt_sets

warnings.simplefilter("ignore")


def engine(dtype: str) -> Engine:
    return Engine.from_pretrained(device="cpu", dtype=getattr(torch, dtype))


def benchmark_prompts() -> list:
    sets = load_prompt_sets(["mtbench", "alpaca"], 16, 0)
    return [p.text for ps in sets.values() for p in ps]
