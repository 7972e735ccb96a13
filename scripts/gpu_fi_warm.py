"""Warm FlashInfer's JIT cache on the GPU host and check the custom-mask batch prefill once.

    python scripts/gpu_fi_warm.py --configs bf16:64:9:3 fp16:64:4:2 bf16:128:32:8 --done .gpu-state/fi_warm.json

Each config ``dtype:head_dim:q_heads:kv_heads`` compiles one batch-prefill module (the first use
compiles it with nvcc; minutes) in its own process, all in parallel, after one import in this
process (which builds tvm-ffi's torch addon if this torch needs it). Every process then runs one
paged prefill over prefix + tree with a random tree mask, laid out like heterospec's FlashInfer
backend (one page per request, page_size = S_max), and compares it with a float32 SDPA reference
built here from the same bool mask (independent of heterospec's ops). The JSON written to
``--done`` records per config: compile+first-call seconds, max abs error, ok.

The JIT cache goes where FLASHINFER_WORKSPACE_BASE points (scripts/gpu_session.sh: .gpu-cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _tree_mask(T: int, gen, torch):
    """[T, T] bool: node i sees itself and its ancestors (random parents, topological order)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def check_one(spec: str) -> dict:
    import torch
    import torch.nn.functional as F

    import flashinfer

    name, hd, hq, hkv = spec.split(":")
    dtype, D, Hq, Hkv = getattr(torch, DTYPES[name]), int(hd), int(hq), int(hkv)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    B, T, S = 3, 24, 256
    prefix = [200, 7, 0]  # the last request: a tree with no prefix
    k = torch.randn(B, S, Hkv, D, generator=gen).to(dev, dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen).to(dev, dtype)
    q = torch.randn(B * T, Hq, D, generator=gen).to(dev, dtype)
    blocks, dense = [], []
    for L in prefix:
        tm = _tree_mask(T, gen, torch)
        blk = torch.cat([torch.ones(T, L, dtype=torch.bool), tm], 1)  # [T, L + T]
        blocks.append(blk.flatten())
        dense.append(blk)
    custom_mask = torch.cat(blocks).to(dev)
    i32 = dict(dtype=torch.int32, device=dev)
    kv_lens = torch.tensor([L + T for L in prefix], **i32)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD")
    t0 = time.perf_counter()
    wrapper.plan(torch.arange(B + 1, **i32) * T, torch.arange(B + 1, **i32), torch.arange(B, **i32), kv_lens,
                 Hq, Hkv, D, S, custom_mask=custom_mask, q_data_type=dtype, kv_data_type=dtype, sm_scale=D**-0.5)
    out = wrapper.run(q, (k, v))
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    err = 0.0
    for b, L in enumerate(prefix):
        W = L + T
        qb = q[b * T:(b + 1) * T].float().transpose(0, 1)               # [Hq, T, D]
        kb = k[b, :W].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        vb = v[b, :W].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        ref = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=dense[b].to(dev), scale=D**-0.5)
        err = max(err, float((out[b * T:(b + 1) * T].float() - ref.transpose(0, 1)).abs().max()))
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    return {"config": spec, "first_call_s": round(first, 1), "max_abs_err": err, "tol": tol, "ok": err <= tol}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["bf16:64:9:3", "fp16:64:4:2", "bf16:128:32:8"])
    p.add_argument("--done", help="write the JSON summary here (written last: its presence means finished)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(check_one(args.one)), flush=True)
        return 0
    t0 = time.perf_counter()
    results, status = [], 0
    try:
        import flashinfer
        import torch

        print(f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, "
              f"import {time.perf_counter() - t0:.1f} s", flush=True)
        procs = [(c, subprocess.Popen([sys.executable, __file__, "--one", c], stdout=subprocess.PIPE, text=True))
                 for c in args.configs]
        for c, proc in procs:
            out, _ = proc.communicate()
            line = (out or "").strip().splitlines()[-1:] or [""]
            try:
                r = json.loads(line[0])
            except ValueError:
                r = {"config": c, "ok": False, "error": f"exit code {proc.returncode}; see the log"}
            print(json.dumps(r), flush=True)
            results.append(r)
            status |= 0 if r.get("ok") else 1
    except Exception as exc:  # recorded, never raised: the session goes on without FlashInfer
        results.append({"ok": False, "error": repr(exc)})
        status = 1
    summary = {"ok": status == 0, "seconds": round(time.perf_counter() - t0, 1), "results": results}
    if args.done:
        tmp = args.done + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, args.done)
    print(json.dumps(summary), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
