"""Shared pytest fixtures. Keep minimal; append new fixtures at the end."""

import os
import random

import pytest
import torch

# No network in tests: a data / model package that is neither installed nor in the heterospec cache
# is reported (tests that need it skip) instead of being downloaded (heterospec.fetch).
os.environ.setdefault("HETEROSPEC_NO_FETCH", "1")

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
