"""Shared pytest fixtures. Keep minimal; append new fixtures at the end."""

import os
import random

import pytest
import torch

# No network in tests: a data / model package that is neither installed nor in the heterospec cache
# is reported (tests that need it skip) instead of being downloaded (heterospec.fetch).
os.environ.setdefault("HETEROSPEC_NO_FETCH", "1")

# Under pytest-xdist (README: `-n auto`), each worker gets its share of the cores for torch's
# intra-op threads, and so do the processes the tests start: two workers with two threads each on
# two cores spin in each other's OpenMP barriers, much slower than one worker alone.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    _share = max(1, len(os.sched_getaffinity(0)) // _WORKERS) if hasattr(os, "sched_getaffinity") \
        else max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def devices(request) -> str:
    """Every available device: "cpu", plus "cuda" when a GPU is visible."""
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    """Deterministic randomness in every test."""
    random.seed(0)
    torch.manual_seed(0)
    yield
