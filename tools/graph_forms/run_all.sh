#!/usr/bin/env bash
# Regenerate every dump in out/ (about 1-2 minutes on CPU). Usage: bash run_all.sh
set -e
cd "$(dirname "$0")"
mkdir -p out
for f in fam1_pool fam2_const fam3_symint fam3b_seed001 fam3c_slots fam4_mask fam5_cond \
         fam6_wrappers fam6b_autocast_fx fam7_mutation fam8_composites; do
  echo "== $f"; python "$f.py" >/dev/null 2>&1 || echo "FAILED: $f"
done
python schemas.py > out/schemas.txt 2>/dev/null
python metakeys.py > out/metakeys.txt
echo "dumps in out/; filter with: python show.py out/famN.txt REGEX [--meta]"
