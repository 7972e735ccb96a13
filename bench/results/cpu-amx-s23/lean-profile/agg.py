import sys, collections, re
def load(path):
    procs = collections.defaultdict(lambda: collections.Counter())
    totals = collections.Counter()
    for line in open(path):
        line = line.rstrip("\n")
        stack, _, cnt = line.rpartition(" ")
        try: cnt = int(cnt)
        except ValueError: continue
        frames = stack.split(";")
        nproc = sum(1 for f in frames if f.startswith("process "))
        kind = {1: "main", 2: "core", 3: "worker"}.get(nproc, str(nproc))
        totals[kind] += cnt
        seen = set()
        for f in frames:
            if f.startswith("process "): continue
            name = re.sub(r" \((.*?):\d+\)", r" (\1)", f)
            if name in seen: continue
            seen.add(name)
            procs[kind][name] += cnt
    return procs, totals
a, ta = load(sys.argv[1]); b, tb = load(sys.argv[2])
for kind in ("worker", "core"):
    print(f"== {kind}: samples {ta[kind]} vs {tb[kind]}")
    keys = set(a[kind]) | set(b[kind])
    rows = sorted(keys, key=lambda k: -(abs(b[kind][k] - a[kind][k])))
    for k in rows[:int(sys.argv[3]) if len(sys.argv) > 3 else 40]:
        print(f"{a[kind][k]:7d} {b[kind][k]:7d} {b[kind][k]-a[kind][k]:+7d}  {k[:150]}")
