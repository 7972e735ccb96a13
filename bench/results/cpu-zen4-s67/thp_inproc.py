"""Two engines in one process, calls alternated: weights on 4 KB pages vs the same weights
collapsed into 2 MB pages (madvise MADV_HUGEPAGE + MADV_COLLAPSE on each large tensor)."""
import ctypes, sys, time, torch, heterospec
from heterospec.datasets import load_prompts
torch.set_num_threads(2)
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
HUGE = 2 << 20
def tensors_of(model):
    seen = {}
    for mod in model.modules():
        for v in list(vars(mod).values()) + list(mod._parameters.values()) + list(mod._buffers.values()):
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    try:
                        st = t.untyped_storage()
                    except NotImplementedError:
                        seen.setdefault("opaque", 0); seen["opaque"] = seen.get("opaque", 0) + 1; continue
                    seen[st.data_ptr()] = st.nbytes()
    return seen
def collapse(model):
    done = failed = 0
    for ptr, n in tensors_of(model).items():
        if ptr == "opaque": print("opaque tensors", n); continue
        lo = (ptr + HUGE - 1) // HUGE * HUGE; hi = (ptr + n) // HUGE * HUGE
        if hi <= lo: continue
        libc.madvise(lo, hi - lo, 14)
        r = libc.madvise(lo, hi - lo, 25)
        done += hi - lo if r == 0 else 0; failed += 0 if r == 0 else 1
    return done, failed
import mmap
def huge_copy(t):
    nbytes = t.numel() * t.element_size()
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS); m.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(m, dtype=torch.uint8); off = (-buf.data_ptr()) % HUGE
    out = buf[off:off + nbytes].view(t.dtype).view(t.shape); out.copy_(t)
    _keep.append(m)
    return out
_keep = []
def rehome(model, min_bytes=HUGE):
    """Every tensor of at least min_bytes that is file-backed or on 4 KB pages: copied to 2 MB pages."""
    moved, seen = 0, set()
    for mod in model.modules():
        for v in list(vars(mod).values()) + list(mod._parameters.values()) + list(mod._buffers.values()):
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or id(t) in seen: continue
                seen.add(id(t))
                try: n = t.untyped_storage().nbytes()
                except NotImplementedError: continue
                if n < min_bytes or not t.is_contiguous() or t.storage_offset() or n != t.numel() * t.element_size(): continue
                t.data = huge_copy(t.data); moved += n
    return moved
dtype = getattr(torch, sys.argv[1]); method = sys.argv[2]
a = heterospec.Engine.from_pretrained(dtype=dtype)
b = heterospec.Engine.from_pretrained(dtype=dtype)
tb = tensors_of(b.target); print("opaque", tb.pop("opaque", 0), "tensor bytes", sum(tb.values()) / 2**20, "MB")
t = time.perf_counter(); print("rehomed MB", [rehome(m) / 2**20 for m in (b.target, b.draft)], f"{time.perf_counter()-t:.2f}s")
with open("/proc/self/smaps_rollup") as f: print([l.strip() for l in f if "AnonHugePages" in l])
ps = [p.text for p in load_prompts("mtbench", n=8)]
for e in (a, b): e.generate(ps[0], max_new_tokens=16, method=method)
tot = {"4k": [0.0, 0], "2m": [0.0, 0]}
for rep in range(2):
    for p in ps:
        for name, e in (("4k", a), ("2m", b)) if rep % 2 == 0 else (("2m", b), ("4k", a)):
            t = time.perf_counter(); r = e.generate(p, max_new_tokens=96, method=method); dt = time.perf_counter() - t
            tot[name][0] += dt; tot[name][1] += len(r.token_ids)
for k, (s, n) in tot.items(): print(f"{k}: {n/s:.1f} tok/s")
print(f"2m/4k = {(tot['2m'][1]/tot['2m'][0])/(tot['4k'][1]/tot['4k'][0]):.3f}  ({method}, {sys.argv[1]})")
