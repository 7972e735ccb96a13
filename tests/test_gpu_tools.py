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


# a dry run's settings: nothing runs, and the chain looks at its driver five times a second
DRY = dict(GPU_DRY_RUN="1", GPU_CHAIN_POLL_S="0.2", GPU_CHAIN_START_S="0.5")


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
    # forced bins drive the tree: SMOKE_CONFIG (top_k 3, depth 2, 8 nodes) gives these shapes (bin 0:
    # round(0.3 * 8 + 1) = 3 nodes for 4 layers, raised to 4 draft nodes + root by the invariant)
    assert [(x["depth"], x["nodes"]) for x in rows] == [(4, 5), (3, 5), (3, 7), (3, 8), (3, 8), (0, 1)]
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
    (rows,) = lat["split"].values()
    rows[0].update(graph_round_ms=8.0, graph_device_ms=7.6, graph_host_frac=0.05)   # as a CUDA run reports it
    (state / "gpu_latency.json").write_text(json.dumps(lat))
    (state / "gpu_latency.md").write_text("LATENCY TABLE\n")
    summ = _load("scripts/gpu_summary.py", "gpu_summary_test")
    out = tmp_path / "s.md"
    assert summ.main([str(state), str(out), "test_ops", "e2e"]) == 0
    text = out.read_text()
    assert "| test_ops | ok (12s) |" in text and "| e2e | not run |" in text
    assert "1 passed, 1 failed, 1 skipped" in text and "FAILED `t::b`" in text
    assert "LATENCY TABLE" in text and "1.10x, met" in text and "Python share" in text
    assert "host share of a replayed round, " in text and "5% (GPU idle in a 8.00 ms round; goal < 10%), met" in text


def test_shell_scripts_parse():
    for f in ("scripts/gpu_session.sh", "scripts/gpu_wheels.sh", "scripts/gpu_chain.sh", "scripts/gpu_travel.sh"):
        subprocess.run(["bash", "-n", os.path.join(ROOT, f)], check=True)


def test_gpu_travel_light_leaves_the_archive_behind_and_restores_it(tmp_path):
    """scripts/gpu_travel.sh: `light` takes bench/results out of what travels (neither tracked nor
    untracked-not-ignored, files kept on disk), `restore` tracks it again as HEAD has it; an archive
    with uncommitted changes is refused."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    def travel(cmd):
        return subprocess.run(["bash", os.path.join(ROOT, "scripts/gpu_travel.sh"), cmd], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)

    def travelling():
        return set(git("ls-files", "-co", "--exclude-standard").split())

    git("init", "-q")
    (tmp_path / "bench" / "results" / "s1").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "s1" / "e2e.md").write_text("x" * 4096)
    (tmp_path / "bench" / "RESULTS.md").write_text("table\n")
    (tmp_path / "code.py").write_text("print(1)\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    everything = travelling()
    assert "bench/results/s1/e2e.md" in everything

    p = travel("light")
    assert p.returncode == 0, p.stdout + p.stderr
    assert travelling() == everything - {"bench/results/s1/e2e.md"}
    assert (tmp_path / "bench" / "results" / "s1" / "e2e.md").is_file()          # still on disk
    assert "(light)" in travel("size").stdout and "already light" in travel("light").stdout

    p = travel("restore")
    assert p.returncode == 0, p.stdout + p.stderr
    assert travelling() == everything and git("status", "--porcelain") == ""
    assert "not light" in travel("restore").stdout

    (tmp_path / "bench" / "results" / "s2.md").write_text("new\n")              # not yet committed
    p = travel("light")
    assert p.returncode == 1 and "uncommitted" in p.stderr
    assert travelling() == everything | {"bench/results/s2.md"}


def test_gpu_chain_dry_run(tmp_path):
    """scripts/gpu_chain.sh: `start` launches the driver in its own session and returns; `finish`
    waits for it and hands its outputs (summary, logs, chain.log) to $OUT; the driver gives up on
    a bundle that never arrived and still runs every later stage (here: dry-run skips)."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, **DRY, GPU_STATE=str(tmp_path / "state"), OUT=str(out), PYTHON=sys.executable)
    chain = os.path.join(ROOT, "scripts/gpu_chain.sh")
    p = subprocess.run(["bash", chain, "start", "70"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    p = subprocess.run(["bash", chain, "finish", "5"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    log = (out / "chain.log").read_text()
    assert "fi: the last call came without it" in log or "fi: not complete before the deadline" in log
    assert "driver done" in log and "stages: test_engine test_models test_ops;" in log
    assert "stages: latency bench_ops;" in log
    text = (out / "gpu_summary.md").read_text()
    assert "| env | skipped (dry run) |" in text and (out / "gpu_logs.tar.gz").is_file()
    p = subprocess.run(["bash", chain], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "gpu_chain.sh start" in p.stdout


def _dry_chain(tmp_path, **extra_env) -> str:
    """A dry-run chain (start, then finish at once) in tmp_path; returns its chain.log."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, **DRY, GPU_STATE=str(tmp_path / "state"), OUT=str(out),
               PYTHON=sys.executable, **extra_env)
    chain = os.path.join(ROOT, "scripts/gpu_chain.sh")
    assert subprocess.run(["bash", chain, "start", "70"], env=env, capture_output=True, text=True,
                          timeout=60).returncode == 0
    assert subprocess.run(["bash", chain, "finish", "5"], env=env, capture_output=True, text=True,
                          timeout=120).returncode == 0
    return (out / "chain.log").read_text()


def test_gpu_chain_leaves_out_the_stages_asked(tmp_path):
    """GPU_CHAIN_SKIP: stages whose code did not change since the last run are left out of the
    driver (a short lease then reaches train_draft); a session left with none is not started."""
    log = _dry_chain(tmp_path, GPU_CHAIN_SKIP="test_ops bench_ops latency")
    assert "stages: test_engine test_models;" in log and "driver done" in log
    ran = " ".join(line.split("stages: ", 1)[1] for line in log.splitlines() if "stages: " in line)
    assert not {"test_ops", "bench_ops", "latency"} & set(ran.replace(";", " ").split()), ran


def test_gpu_chain_does_not_wait_for_a_bundle_left_out_of_the_payload(tmp_path):
    """GPU_BUNDLES=e2e (a lease for the draft carries no FlashInfer): the driver sees from the
    MANIFEST that fi never comes and goes on at once instead of waiting for the last call."""
    payload = tmp_path / "state" / "payload"
    payload.mkdir(parents=True)
    (payload / "MANIFEST").write_text("e2e 0 100 " + "0" * 64 + "\n")
    log = _dry_chain(tmp_path)
    assert "[chain] fi: not in this payload" in log and "driver done" in log
    assert "fi: the last call came without it" not in log


def test_gpu_session_dry_run(tmp_path):
    env = dict(os.environ, **DRY, GPU_STATE=str(tmp_path / "state"), OUT=str(tmp_path / "out"),
               PYTHON=sys.executable)
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts/gpu_session.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    text = (tmp_path / "out" / "gpu_summary.md").read_text()
    for stage in ("env", "install", "fi_warm", "build", "test_ops", "test_models", "test_engine", "bench_ops",
                  "latency", "e2e", "draft_data", "train_draft"):
        assert f"| {stage} | skipped (dry run) |" in text
    assert (tmp_path / "out" / "gpu_logs.tar.gz").is_file()


def _bundle(path, files):
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as t:
        for name, data in files.items():
            f = path.parent / name
            f.write_bytes(data)
            t.add(f, arcname=name)
    return path.read_bytes()


def test_gpu_session_reassembles_split_payload(tmp_path):
    """scripts/gpu_wheels.sh's layout (two tar bundles as one stream cut into per-call parts, a
    MANIFEST in each call dir): gpu_session.sh unpacks a bundle as soon as all its bytes have
    arrived, over consecutive calls, and checks its sha256."""
    import hashlib

    rnd = __import__("random").Random(0)
    fi = _bundle(tmp_path / "src/fi.tar", {"flashinfer_python-0-py3-none-any.whl": rnd.randbytes(70_000)})
    e2e = _bundle(tmp_path / "src2/e2e.tar", {"model.gguf": rnd.randbytes(90_000), "gguf.sha256": b"x  model.gguf\n"})
    manifest = "".join(f"{n} {off} {len(b)} {hashlib.sha256(b).hexdigest()}\n"
                       for n, off, b in (("fi", 0, fi), ("e2e", len(fi), e2e)))
    stream, chunk = fi + e2e, 40_000
    parts = [stream[i:i + chunk] for i in range(0, len(stream), chunk)]
    state = tmp_path / "state"
    env = dict(os.environ, GPU_STATE=str(state), GPU_PAYLOAD_ONLY="1", OUT=str(tmp_path / "out"),
               PYTHON=sys.executable)
    seen = []
    for i, part in enumerate(parts):  # one call per part; earlier calls' carry dirs are gone
        carry = tmp_path / f"carry{i}"
        (carry / str(i + 1)).mkdir(parents=True)
        (carry / str(i + 1) / f"stream.part-{i:02d}").write_bytes(part)
        (carry / str(i + 1) / "MANIFEST").write_text(manifest)
        p = subprocess.run(["bash", os.path.join(ROOT, "scripts/gpu_session.sh")], env=dict(env, GPU_CARRY=str(carry)),
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        seen.append((state / "payload/fi/.done").exists())
        if (state / "payload/e2e/.done").exists():
            break
    first_fi = seen.index(True)
    assert (first_fi + 1) * chunk >= len(fi) > first_fi * chunk  # unpacked in the call that completed it
    assert (state / "payload/fi/flashinfer_python-0-py3-none-any.whl").stat().st_size == 70_000
    assert (state / "payload/e2e/model.gguf").read_bytes() == (tmp_path / "src2/model.gguf").read_bytes()
    assert "e2e unpacked" in (state / "payload/status").read_text()


def test_host_profile_reports_each_method():
    """bench/host_profile.py (run after the GPU e2e stage): one report section per method, with
    the functions the host spent its time in."""
    import heterospec
    from heterospec import SpecConfig
    from tests.engine_util import tiny_hf_llama

    hp = _load("bench/host_profile.py", "host_profile_smoke")
    target = heterospec.TargetModel.from_hf(tiny_hf_llama(seed=3))
    engine = heterospec.Engine(target, heterospec.Eagle3Draft.for_target(target, seed=3),
                               config=SpecConfig(top_k=3, depth=2, total_tokens=6))
    text = hp.profile_method(engine, "eagle3", [[5, 9, 17, 33]], 6, 5)
    assert text.startswith("## eagle3: 1 calls, 6 tokens")
    assert "### by tottime" in text and "### by cumulative" in text and "generate" in text
