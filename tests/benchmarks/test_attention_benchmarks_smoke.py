"""benchmarks/prefill_attention.py runs its routes on a short prompt and prints one JSON row whose IREE routes match
eager; benchmarks/moe_sort.py's `replaced` route puts a rule loaded from a file in place of the default one (no
timings are asserted: the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fx_rewrites import backends

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_attention_prints_routes_that_match_eager():
    args = ["--rows", "64", "--calls", "1", "--routes", "rules", "rules:KEY_BLOCK=512+peel", "eager_causal"]
    script = ROOT / "benchmarks" / "prefill_attention.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    for route in ("rules", "rules:KEY_BLOCK=512+peel"):  # +peel: compiled with the peel flag added
        assert row[f"{route}_max_abs_diff"] < 1e-5, row  # 8 heads of 64 over 2081 keys: eager's flash ~5e-7 off
        assert row[f"{route}_ms"] > 0
    assert row["eager_causal_ms"] > 0


def test_prefill_attention_takes_rows_of_a_multiple_with_and_without_assumptions():
    args = ["--rows", "64", "--rows-multiple", "8", "--calls", "1", "--routes", "rules:ASSUME_SHAPES=1", "rules"]
    script = ROOT / "benchmarks" / "prefill_attention.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["rows_multiple"] == 8
    for route in ("rules:ASSUME_SHAPES=1", "rules"):
        assert row[f"{route}_max_abs_diff"] < 1e-5, row


def test_prefill_attention_times_an_encoders_attention_on_avx2():
    """`--shape vit`: ViT's attention (static rows, no mask) through the unmasked flash dispatch (`flash`) and the
    route without it (`blocks`), AVX2 code (on an AVX-512 host: znver3 code and torch held to AVX2 in a child)."""
    args = ["--shape", "vit", "--isa", "avx2", "--calls", "1", "--routes", "flash", "blocks", "eager"]
    script = ROOT / "benchmarks" / "prefill_attention.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert (row["isa"], row["tokens"]) == ("avx2", 197)
    for route in ("flash", "blocks"):
        assert row[f"{route}_max_abs_diff"] < 1e-5, row  # 197 keys of 64: eager's flash ~5e-7 off
    assert row["eager_ms"] > 0


def test_moe_sort_replaces_a_rule_by_one_loaded_from_a_file():
    sys.path.insert(0, str(ROOT))
    from benchmarks.moe_sort import _replaced

    rules = backends.get("iree").rules
    path = ROOT / "backends" / "iree" / "rules" / "attention_blocks.py"
    replaced = _replaced(rules, f"{path}:attention_by_key_blocks")
    old = [r for r in rules if r.name == "attention_by_key_blocks"]
    new = [r for r in replaced if r.name == "attention_by_key_blocks"]
    assert len(old) == len(new) == 1 and new[0] is not old[0]  # the file's own rule object, in the same place
    assert [r.name for r in replaced] == [r.name for r in rules]
    with pytest.raises(SystemExit, match="defines no 'not_a_rule'"):
        _replaced(rules, f"{path}:not_a_rule")
    with pytest.raises(SystemExit, match="no rule named 'KEY_BLOCK'"):
        _replaced(rules, f"{path}:KEY_BLOCK")  # in the file, not a rule of the backend


def test_moe_sort_route_names_take_a_chunk_size():
    """`--chunks` names the IREE routes `ROUTE/C` (a prefill in chunks of C); eager takes none, and C is a number."""
    import argparse

    sys.path.insert(0, str(ROOT))
    from benchmarks.moe_sort import _route

    assert _route("counting/256") == "counting/256" and _route("eager") == "eager"
    for bad in ("eager/256", "counting/x", "nonsense"):
        with pytest.raises(argparse.ArgumentTypeError):
            _route(bad)


def test_moe_sort_peel_route_adds_the_peel_flag_only():
    """`peel`: the default rules and flags with `--iree-llvmcpu-vector-pproc-strategy=peel` added (timed on AVX-512,
    where the target does not add it); `counting` has it only where the target's `dynamic_flags` add it later."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.moe_sort import _route, iree_backend

    flag = "--iree-llvmcpu-vector-pproc-strategy=peel"
    plain, peel = iree_backend("counting"), iree_backend(_route("peel"))
    assert peel.perf_flags == (*plain.perf_flags, flag)
    assert flag not in plain.perf_flags
    assert [r.name for r in peel.rules] == [r.name for r in plain.rules]
