"""Aggregate node.meta key sets per route (from out/fam*.txt dumps)."""
import re, glob, collections
agg = collections.defaultdict(collections.Counter)
for f in sorted(glob.glob("out/fam[0-9]*.txt")):
    route = None
    for line in open(f):
        if line.startswith("### "):
            r = line[4:].strip()
            route = ("R1" if r.startswith("R1") else "R2" if r.startswith("R2") else
                     "R3" if r.startswith("R3") else "R4p" if "pre_dispatch" in r else "R4" if r.startswith("R4") else None)
            continue
        if route is None or line.startswith("    "):  # skip submodule lines
            continue
        m = re.search(r"   meta=(\[.*\])$", line.rstrip())
        if not m:
            continue
        kind = ("placeholder(SymInt)" if "placeholder" in line and ":: Sym" in line else
                "placeholder" if "placeholder" in line else "get_attr" if "get_attr" in line else
                "output" if line.startswith("output") else
                "_assert_*" if "_assert" in line else "sym_size/operator" if ("sym_size" in line or "_operator." in line and "getitem" not in line) else
                "getitem" if "getitem" in line else "multi-output op" if ":: (" in line else "op")
        agg[(route, kind)][m.group(1)] += 1
for (route, kind), c in sorted(agg.items()):
    for keys, n in c.most_common(3):
        print(f"{route:4s} {kind:20s} {n:4d}x {keys}")
