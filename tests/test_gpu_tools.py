"""CPU checks of the GPU-session tooling (no GPU needed): bench/gpu_latency.py's smoke path,
the shell scripts' syntax, a dry run of scripts/gpu_session.sh and scripts/gpu_summary.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_latency")
    gl = _load("bench/gpu_latency.py", "gpu_latency_smoke")
    assert gl.main(["--cpu-smoke", "--json", str(out / "r.json"), "--md", str(out / "r.md")]) == 0
    return out


def test_gpu_latency_cpu_smoke(smoke):
    r = json.loads((smoke / "r.json").read_text())
    assert r["weights"] == "random" and r["dtype"] == "torch.float32"
    verify = [x for x in r["verify"] if "error" not in x]
    assert {(x["T"], x["backend"]) for x in verify} == {(0, "sdpa"), (1, "sdpa"), (4, "sdpa")}
    assert all(x["ms"] > 0 for x in verify) and [x["x_decode"] for x in verify if x["T"] == 0] == [1.0]
    (rows,) = r["split"].values()
    assert [x["config"] for x in rows] == ["heterospec bin 0", "heterospec bin 1", "heterospec bin 2",
                                           "heterospec bin 3", "eagle3", "autoregressive"]
    # forced bins drive the tree: SMOKE_CONFIG (top_k 3, depth 2, 8 nodes) gives these shapes
    assert [(x["depth"], x["nodes"]) for x in rows] == [(4, 3), (3, 5), (3, 7), (3, 8), (3, 8), (0, 1)]
    for x in rows:
        parts = x["draft_ms"] + x["verify_ms"] + x["ops_ms"] + x["python_ms"]
        assert abs(parts - x["split_total_ms"]) < 0.01 + 1e-3 * x["split_total_ms"]
    assert "Per-step split" in (smoke / "r.md").read_text()


def test_gpu_summary_reports_goals(smoke, tmp_path):
    state = tmp_path / "state"
    (state / "status").mkdir(parents=True)
    (state / "status" / "test_ops").write_text("ok (12s)\n")
    (state / "junit_test_ops.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure/></testcase>'
        '<testcase classname="t" name="c"><skipped/></testcase></testsuite></testsuites>')
    lat = json.loads((smoke / "r.json").read_text())
    lat["verify"].append(dict(backend="flashinfer", mode="graph", context=1024, T=64, ms=1.0, x_decode=1.1))
    (state / "gpu_latency.json").write_text(json.dumps(lat))
    (state / "gpu_latency.md").write_text("LATENCY TABLE\n")
    summ = _load("scripts/gpu_summary.py", "gpu_summary_test")
    out = tmp_path / "s.md"
    assert summ.main([str(state), str(out), "test_ops", "e2e"]) == 0
    text = out.read_text()
    assert "| test_ops | ok (12s) |" in text and "| e2e | not run |" in text
    assert "1 passed, 1 failed, 1 skipped" in text and "FAILED `t::b`" in text
    assert "LATENCY TABLE" in text and "1.10x, met" in text and "Python share" in text


def test_shell_scripts_parse():
    for f in ("scripts/gpu_session.sh", "scripts/gpu_wheels.sh"):
        subprocess.run(["bash", "-n", os.path.join(ROOT, f)], check=True)


def test_gpu_session_dry_run(tmp_path):
    env = dict(os.environ, GPU_DRY_RUN="1", GPU_STATE=str(tmp_path / "state"), OUT=str(tmp_path / "out"),
               PYTHON=sys.executable)
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts/gpu_session.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    text = (tmp_path / "out" / "gpu_summary.md").read_text()
    for stage in ("env", "install", "fi_warm", "build", "test_ops", "test_models", "test_engine", "bench_ops",
                  "latency", "e2e"):
        assert f"| {stage} | skipped (dry run) |" in text
    assert (tmp_path / "out" / "gpu_logs.tar.gz").is_file()
