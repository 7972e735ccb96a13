import sys, collections, re
sys.argv += []
exec(open('agg.py').read().split("a, ta = load")[0])
a, ta = load(sys.argv[1]); b, tb = load(sys.argv[2])
pat = re.compile(sys.argv[3])
for kind in ("worker", "core"):
    print("==", kind)
    keys = sorted(k for k in set(a[kind]) | set(b[kind]) if pat.search(k))
    for k in keys:
        print(f"{a[kind][k]:7d} {b[kind][k]:7d}  {k[:140]}")
