"""Legalize decompositions on NaN, infinities and -0.0: each OpInfo op the IREE legalize phase decomposes,
against eager (issue 27: a decomposition may turn IREE's loud failure into a wrong number).

Each OpInfo op's first float32 sample, its float inputs filled with NaN, inf, -inf, -0.0, 0.0 and ordinary
numbers in turn, is exported statically and rewritten with the IREE backend's rules; where
`legalize_for_iree` fired, the result is compiled on IREE and compared with eager: NaN where eager has NaN,
the same infinities, finite values within the OpInfo corpus's tolerance (zero's sign is not compared). One
JSON line per op; `status` is "pass", "wrong" (with `diff`: IREE's values, eager's, how many of how many),
"compile" (IREE rejected the rewritten program: loud) or "skip" (eager or export failed).

    python benchmarks/special_values.py [OPS...]     # ~3 minutes for the ~125 ops on 2 cores

Static only: Dim variants would double it, empty inputs are the predicate family's test
(tests/backends/iree/rules/test_float_predicates.py).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parent))

import opinfo_cases as oc

import fx_rewrites
from fx_rewrites import backends

SPECIALS = (math.nan, math.inf, -math.inf, -0.0, 0.0, 1.5, -2.5, 0.5, 3.0, -1.0, 2.0, -0.5)
#: ops whose eager CPU kernels (LAPACK / MKL) crash or hang on NaN input: nothing to compare with
EAGER_CRASHES = ("linalg.", "eig", "geqrf", "lu", "svd", "pinverse", "matrix_exp", "cholesky", "ormqr", "qr",
                 "triangular_solve", "inverse", "logdet", "det", "slogdet", "pca_lowrank", "lobpcg", "matrix_power",
                 "nanmedian")  # fmt: skip


def special(t: Any) -> Any:
    """A float tensor's elements replaced by `SPECIALS` in turn; anything else as is."""
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.numel() == 0:
        return t
    values = torch.tensor(SPECIALS, dtype=t.dtype)
    return values[torch.arange(t.numel()) % len(values)].reshape(t.shape).clone()


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    if got.dtype.is_floating_point and want.dtype.is_floating_point:
        close = torch.isfinite(got) & torch.isfinite(want) & ((got - want).abs() <= oc.ATOL + oc.RTOL * want.abs())
        return ~((got == want) | (got.isnan() & want.isnan()) | close)
    return got != want


def diff(got: Any, want: Any) -> list[Any] | None:
    """None when `got` matches `want`; else [IREE's values, eager's, how many differ, of how many]."""
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return [len(got_leaves), len(want_leaves), 1, 1]
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if not isinstance(w, torch.Tensor) or w.is_complex():
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape:
            return [str(getattr(g, "shape", g)), str(w.shape), 1, 1]
        bad = _mismatch(g, w.to(g.dtype) if g.dtype != w.dtype else w).flatten()
        if bool(bad.any()):
            return [g.flatten()[bad][:4].tolist(), w.flatten()[bad][:4].tolist(), int(bad.sum()), bad.numel()]
    return None


def check(op: Any, iree: Any) -> dict[str, Any] | None:
    """One op's record, or None when the legalize phase does not decompose it."""
    if torch.float32 not in op.supported_dtypes("cpu") or op.name.startswith(EAGER_CRASHES):
        return None
    found = oc.samples(op, torch.float32, 1)
    if not found:
        return None
    sample = found[0]
    sample.input, sample.args, sample.kwargs = pytree.tree_map(special, (sample.input, sample.args, sample.kwargs))
    module = oc.OpModule(op.op, sample)
    verdict, expected = oc.eager(module)
    if verdict != "ok":
        return {"status": "skip", "why": verdict}
    try:
        program = oc._export(module, "static")
        if oc._random_ops(program):
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fx_rewrites.apply(program, iree.rules)
    except Exception as e:  # an export or a named decline: not this check's subject
        return {"status": "skip", "why": type(e).__name__}
    if "legalize_for_iree" not in result.report.rewrites:
        return None
    try:
        got = iree.compile(result.program, module.fresh_inputs())(*module.fresh_inputs())
    except Exception as e:
        return {"status": "compile", "why": type(e).__name__}
    found_diff = diff(got, expected)
    return {"status": "pass"} if found_diff is None else {"status": "wrong", "diff": found_diff}


def main(argv: list[str]) -> int:
    iree = backends.get("iree")
    for key, op in oc.load_ops().items():
        if argv and key not in argv:
            continue
        try:
            record = check(op, iree)
        except Exception as e:  # a sample torch cannot build: reported, not fatal
            record = {"status": "skip", "why": f"{type(e).__name__}: {str(e)[:80]}"}
        if record is not None:
            print(json.dumps({"op": key, **record}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
