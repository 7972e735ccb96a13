"""Run a script once per CPU instruction-set path of our kernels (each read once per process, so
each needs its own process) and load what it saved."""

import os
import subprocess
import sys

import torch

ISA_VARS = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "HETEROSPEC_CPU_SCALAR")
# native: the machine's (AVX-512 where it has it); avx2: what an emulated AVX2 CPU runs; scalar: the
# portable loops (what non-x86 machines run)
ISA_RUNS = {"native": {}, "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
            "scalar": {"HETEROSPEC_CPU_SCALAR": "1"}}


def run_on_each_isa(script: str, tmp_path, *args: str) -> dict:
    """``{run name: torch.load(<file the script saved>)}``; the script gets the file to write as
    ``sys.argv[1]`` and ``args`` after it."""
    results = {}
    for name, extra in ISA_RUNS.items():
        env = {k: v for k, v in os.environ.items() if k not in ISA_VARS}
        env.update(extra)
        path = tmp_path / f"{name}.pt"
        run = subprocess.run([sys.executable, "-c", script, str(path), *args], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        results[name] = torch.load(path)
    return results
