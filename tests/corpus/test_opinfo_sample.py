"""A fixed sample of the OpInfo corpus (benchmarks/opinfo_corpus.py) in CI.

Each op's first sample input, exported statically and with Dim.AUTO dims,
compiled on IREE as exported and after the IREE backend's rules, compared
with eager. Asserted for every op: nothing that passes as exported fails
after the rules, and `apply` never crashes; and for each op, what IREE does
as exported and after the rules (the table in docs/opinfo.md, for these ops).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

#: op -> (static as exported, static after the rules); ops the issue names, and plain ones that must stay passing
EXPECTED = {
    "mul": ("pass", "pass"),
    "nn.functional.conv2d": ("pass", "pass"),
    "softmax": ("pass", "pass"),
    "nn.functional.pad.reflect": ("pass", "pass"),
    "histc": ("compile", "pass"),  # hand-written lowering: torch cannot decompose it
    "kthvalue": ("compile", "pass"),  # hand-written: topk(largest=False)
    "xlogy": ("compile", "pass"),  # legalize: torch._decomp
    "nn.functional.unfold": ("compile", "pass"),  # legalize: aten.im2col
    "nn.functional.nll_loss": ("compile", "pass"),  # legalize: nll_loss_nd -> nll_loss_forward -> ...
    "addmv": ("compile", "pass"),  # legalize: not in torch-mlir's dialect
    "logcumsumexp": ("unsupported", "pass"),  # IREE gives inf: refused as exported (wrong_forms), hand-written lowering
    "median": ("compile", "compile"),  # no decomposition, no rule: IREE's error names the op
}


@pytest.fixture(scope="module")
def corpus():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import opinfo_cases

        from fx_rewrites import backends

        backend = backends.get("iree")
        yield opinfo_cases, opinfo_cases.load_ops(), backend
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_opinfo_op_on_iree(corpus, name):
    cases, ops, backend = corpus
    op = ops[name]
    sample = cases.samples(op, cases.pick_dtype(op), 1)[0]
    records = {variant: cases.check(op, sample, variant, backend, backend.rules) for variant in cases.VARIANTS}
    for variant, record in records.items():
        if record["status"] != "checked":
            continue  # torch's side (export, random, specialised): nothing to compare
        exported, after = record["exported"]["status"], record["after"]["status"]
        assert after != "apply-crash", f"{name} {variant}: apply crashed: {record['after']['why']}"
        assert not (exported == "pass" and after != "pass"), (
            f"{name} {variant}: passes as exported, {after} after the rules: {record['after']['why']}"
        )
    static = records["static"]
    assert static["status"] == "checked", static
    got = (static["exported"]["status"], static["after"]["status"])
    assert got == EXPECTED[name], f"{name}: {got}, expected {EXPECTED[name]}: {static['after'].get('why', '')}"
