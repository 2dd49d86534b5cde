"""show.py out/famN.txt REGEX [--meta]: print matching node lines grouped by case/route."""
import re, sys
path, rx = sys.argv[1], re.compile(sys.argv[2])
meta = "--meta" in sys.argv
case = route = None
for line in open(path):
    line = line.rstrip("\n")
    if line.startswith("## "):
        case = line[3:]; print(f"\n## {case}"); continue
    if line.startswith("### "):
        route = line[4:]; printed_route = False; continue
    if rx.search(line):
        if not meta:
            line = re.sub(r"   meta=\[.*\]$", "", line)
        if not printed_route:
            print(f"  [{route}]"); printed_route = True
        print("    " + line)
