"""Markdown summary of a GPU session's state directory (called by scripts/gpu_session.sh).

    python scripts/gpu_summary.py .gpu-state OUT/gpu_summary.md STAGE...

Reads status/<stage>, junit_*.xml, fi_warm.json, bench_ops_cuda.json (pytest-benchmark),
gpu_latency.json / .md, split_default.md and e2e/e2e.md; writes one Markdown file meant to be
pasted (after review) into bench/RESULTS.md, with the issue's goals checked where figures exist.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import xml.etree.ElementTree as ET


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _json(path: str):
    text = _read(path)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def device_line(state: str) -> str:
    """From the env stage's log (nvidia-smi + torch lines) when present, else from torch."""
    env = _read(os.path.join(state, "logs", "env.log")) or ""
    smi = [l for l in env.splitlines() if l.startswith("NVIDIA ") and "," in l]
    tv = [l.split(" _CudaDeviceProperties")[0] for l in env.splitlines() if l.startswith("torch ")]
    if smi and tv:
        return f"{smi[0]} (nvidia-smi: name, driver, memory, max SM / memory clocks); {tv[0]}"
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; torch "
                    f"{torch.__version__}, CUDA {torch.version.cuda}")
        return f"no CUDA device visible (torch {torch.__version__})"
    except Exception as exc:  # the summary must never fail on this
        return f"unknown ({exc!r})"


def junit(state: str) -> list[str]:
    lines = []
    for name in sorted(os.listdir(state)):
        if not (name.startswith("junit_") and name.endswith(".xml")):
            continue
        try:
            root = ET.parse(os.path.join(state, name)).getroot()
        except ET.ParseError:
            lines.append(f"- `{name}`: unreadable")
            continue
        suites = [root] if root.tag == "testsuite" else list(root)
        n = sum(int(s.get("tests", 0)) for s in suites)
        fail = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
        skip = sum(int(s.get("skipped", 0)) for s in suites)
        lines.append(f"- **{name[6:-4]}**: {n - fail - skip} passed, {fail} failed, {skip} skipped")
        bad = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
        lines += [f"  - FAILED `{b}`" for b in bad[:20]]
    return lines


def bench_ops(state: str) -> tuple[list[str], float | None]:
    data = _json(os.path.join(state, "bench_ops_cuda.json"))
    if not data:
        return [], None
    rows = ["| benchmark | GPU us/call | wall us (median) | TB/s | HBM fraction |", "|---|---:|---:|---:|---:|"]
    best = None
    for b in data.get("benchmarks", []):
        x = b.get("extra_info", {})
        frac = x.get("hbm_fraction")
        if frac is not None and "bandwidth" in b["name"]:
            best = max(best or 0.0, frac)
        rows.append(f"| {b['name']} | {x.get('gpu_us', '')} | {1e6 * b['stats']['median']:.1f} | "
                    f"{x.get('TBps', '')} | {frac if frac is not None else ''} |")
    return rows, best


def goals(state: str, hbm: float | None) -> list[str]:
    out = []
    lat = _json(os.path.join(state, "gpu_latency.json")) or {}
    for r in lat.get("verify", []):
        if r.get("context") == 1024 and r.get("T") == 64 and "x_decode" in r:
            ok = "met" if r["x_decode"] <= 1.2 else "NOT met"
            out.append(f"- verify 64 tokens at 1k context within 1.2x of a one-token step ({r['backend']}, "
                       f"{r['mode']}): {r['x_decode']:.2f}x, {ok}")
    for name, rows in lat.get("split", {}).items():
        for r in rows:
            if r.get("graph_host_frac") is not None:
                ok = "met" if r["graph_host_frac"] < 0.1 else "NOT met"
                out.append(f"- host share of a replayed round, {name}, {r['config']}: "
                           f"{100 * r['graph_host_frac']:.0f}% (GPU idle in a {r['graph_round_ms']:.2f} ms round; "
                           f"goal < 10%), {ok}")
            else:
                out.append(f"- Python share of a step, {name}, {r['config']}: {100 * r['python_frac']:.0f}% "
                           f"(goal < 10% with graphs on; these are eager figures)")
    if hbm is not None:
        out.append(f"- topk_entropy at >= 70% of HBM bandwidth: best {100 * hbm:.0f}%, "
                   f"{'met' if hbm >= 0.7 else 'NOT met'}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    state, out_path, stages = argv[0], argv[1], argv[2:]
    md = ["# GPU session summary", "",
          f"Date (UTC): {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
          f"Device: {device_line(state)}", "", "## Stages", "", "| stage | status |", "|---|---|"]
    for s in stages:
        md.append(f"| {s} | {(_read(os.path.join(state, 'status', s)) or 'not run').strip()} |")
    fi = _json(os.path.join(state, "fi_warm.json"))
    if fi:
        md += ["", "## FlashInfer JIT warm-up (custom-mask paged prefill vs float32 SDPA)", ""]
        md += [f"- `{json.dumps(r)}`" for r in fi.get("results", [])] + [f"- total {fi.get('seconds')} s"]
    tests = junit(state)
    if tests:
        md += ["", "## Tests", ""] + tests
    rows, hbm = bench_ops(state)
    if rows:
        md += ["", "## CUDA op microbenchmarks (bench/bench_ops_cuda.py --benchmark-only)", ""] + rows
    for title, name in (("8B-shaped verification latency and per-step split (bench/gpu_latency.py)", "gpu_latency.md"),
                        ("Per-step split, default pair (real weights)", "split_default.md"),
                        ("End-to-end, default pair (bench/e2e.py)", os.path.join("e2e", "e2e.md"))):
        text = _read(os.path.join(state, name))
        if text:
            md += ["", f"## {title}", "", text.strip()]
    g = goals(state, hbm)
    if g:
        md += ["", "## Issue goals", ""] + g
    md += ["", "Logs: gpu_logs.tar.gz (logs/<stage>.log, JUnit XML, JSON)."]
    with open(out_path, "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
