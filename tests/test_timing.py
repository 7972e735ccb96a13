"""heterospec.timing: synchronised timestamps and stage timers (CPU; the CUDA part needs a GPU)."""

import time

import pytest
import torch

from heterospec.timing import StageTimer, synchronize, timestamp


def test_cpu_timestamps_and_stages():
    synchronize("cpu")
    synchronize(torch.device("meta"))
    synchronize(None)
    t0 = timestamp("cpu")
    t = StageTimer("cpu")
    assert not t.use_events
    time.sleep(0.01)
    t.mark("draft")
    t.mark("verify")
    time.sleep(0.005)
    t.mark("draft")  # a repeated stage accumulates
    laps = t.laps()
    assert list(laps) == ["draft", "verify"] and laps["draft"] >= 0.014 and laps["verify"] >= 0
    assert t.total() == pytest.approx(sum(laps.values()))
    assert timestamp("cpu") - t0 >= 0.015
    t.reset()
    assert t.laps() == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_stage_timer_measures_device_work():
    x = torch.randn(4096, 4096, device="cuda")
    for sync in (False, True):
        t = StageTimer("cuda", sync=sync)
        assert t.use_events == (not sync)
        for _ in range(20):
            x = x @ x
            x = x / x.norm()
        t.mark("matmul")
        t.mark("nothing")
        laps = t.laps()
        assert laps["matmul"] > 1e-4 and laps["nothing"] < laps["matmul"]
