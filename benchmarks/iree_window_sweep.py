"""Pooling and convolution x Dim ranges where the output size is constant, on IREE 3.13: static vs Dim sizes,
as exported vs after the backend's rules, compared with eager at sizes across the range.

Finds the members of the "one window over a longer map" family (docs/iree-3.13-findings.md section 8):
each case is a module whose window op's output is the same for every size its Dim range allows (1, or 2),
or whose input has no batch dim. A user typed with static sizes (`* 2`, a squeeze) follows the op, as in
the forms IREE got wrong. Each row: the rules that fired, then per size `ok`, `WRONG` (a silent wrong
result) or `runerr`, or the compile error. IREE is run with its wrong-forms refusal off, to see IREE itself.

    python benchmarks/iree_window_sweep.py [FILTER]     # FILTER: a substring of the case names
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends

IREE = attrs.evolve(backends.get("iree"), refuse_wrong_forms=False)
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class Window(torch.nn.Module):
    """`fn(x, [weight], **kwargs)`, then `user` on its values (indices returned as they are)."""

    def __init__(self, fn: Callable, nsp: int, user: str = "mul", conv: tuple[int, int] | None = None, **kwargs):
        super().__init__()
        self.fn, self.kwargs, self.user = fn, kwargs, user
        self.weight = None
        if conv is not None:
            kernel, groups = conv
            g = torch.Generator().manual_seed(0)
            self.weight = torch.nn.Parameter(torch.randn(4, 4 // groups, *[kernel] * nsp, generator=g))

    def forward(self, x: torch.Tensor) -> Any:
        y = self.fn(x, self.weight, **self.kwargs) if self.weight is not None else self.fn(x, **self.kwargs)
        values = y[0] if isinstance(y, tuple) else y
        values = values * 2 if self.user == "mul" else values.squeeze(-1).squeeze(-1)
        return (values, y[1]) if isinstance(y, tuple) else values


#: (name, module, spatial dims, Dim range, batched)
Case = tuple[str, Window, int, tuple[int, int], bool]


def cases() -> Iterator[Case]:
    """Every case: convolutions, pools with an output of 2, adaptive pools, squeezes, unbatched inputs."""
    for nsp in (1, 2, 3):
        hi = 11 if nsp < 3 else 8
        conv = CONV[nsp]
        yield f"conv{nsp}d k6s6", Window(conv, nsp, conv=(6, 1), stride=6), nsp, (6, hi), True
        yield f"conv{nsp}d k3s5", Window(conv, nsp, conv=(3, 1), stride=5), nsp, (3, 7), True
        yield f"conv{nsp}d k5s4p1", Window(conv, nsp, conv=(5, 1), stride=4, padding=1), nsp, (3, 6), True
        yield f"conv{nsp}d k3s5d2", Window(conv, nsp, conv=(3, 1), stride=5, dilation=2), nsp, (5, 9), True
        yield f"conv{nsp}d k3s3 out2", Window(conv, nsp, conv=(3, 1), stride=3), nsp, (6, 8), True
        yield f"conv{nsp}d k6s6 groups2", Window(conv, nsp, conv=(6, 2), stride=6, groups=2), nsp, (6, hi), True
        maxp, avgp = getattr(F, f"max_pool{nsp}d"), getattr(F, f"avg_pool{nsp}d")
        yield f"max{nsp}d k3 out2 idx", Window(maxp, nsp, kernel_size=3, return_indices=True), nsp, (6, 8), True
        yield f"avg{nsp}d k3 out2", Window(avgp, nsp, kernel_size=3), nsp, (6, 8), True
        yield f"lp{nsp}d k6", Window(getattr(F, f"lp_pool{nsp}d"), nsp, norm_type=2, kernel_size=6), nsp, (6, hi), True
        for out in (1, 2):
            adaptive_max = getattr(F, f"adaptive_max_pool{nsp}d")
            yield f"adamax{nsp}d o{out}", Window(adaptive_max, nsp, output_size=out), nsp, (6, hi), True
            module = Window(adaptive_max, nsp, output_size=out, return_indices=True)
            yield f"adamax{nsp}d o{out} idx", module, nsp, (6, hi), True
            module = Window(getattr(F, f"adaptive_avg_pool{nsp}d"), nsp, output_size=out)
            yield f"adaavg{nsp}d o{out}", module, nsp, (6, hi), True
        yield f"UNB max{nsp}d k2 idx", Window(maxp, nsp, kernel_size=2, return_indices=True), nsp, (6, 8), False
        yield f"UNB avg{nsp}d k2", Window(avgp, nsp, kernel_size=2), nsp, (6, 8), False
        yield f"UNB max{nsp}d k6 idx", Window(maxp, nsp, kernel_size=6, return_indices=True), nsp, (6, 8), False
        yield f"UNB conv{nsp}d k6s6", Window(conv, nsp, conv=(6, 1), stride=6), nsp, (6, 8), False
    yield "max2d k6 squeeze", Window(F.max_pool2d, 2, user="squeeze", kernel_size=6), 2, (6, 11), True
    yield "conv2d k6s6 squeeze", Window(F.conv2d, 2, user="squeeze", conv=(6, 1), stride=6), 2, (6, 11), True


def _flat(value: Any) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def run(case: Case, dynamic: bool, rules: bool) -> str:
    """One row: what the rules fired and the result at each size, or the error."""
    _, module, nsp, (lo, hi), batched = case

    def x(size: int, batch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(size)
        return torch.randn(*((batch,) if batched else ()), 4, *[size] * nsp, generator=g)

    dims = {(1 if batched else 0) + 1 + i: Dim(f"s{i}", min=lo, max=hi) for i in range(nsp)}
    if batched:
        dims[0] = Dim("b")
    example = x(lo if dynamic else hi, 2)
    try:
        program = torch.export.export(module, (example,), dynamic_shapes=(dims,) if dynamic else None)
    except Exception as e:  # torch.export specialises some pooled dims ("Constraints violated")
        return f"export error: {str(e).splitlines()[0][:100]}"
    fired = ""
    if rules:
        result = fx_rewrites.apply(program, IREE.rules)
        program, fired = result.program, ",".join(sorted(result.report.rewrites))
    try:
        fn = IREE.compile(program, (example,))
    except Exception as e:
        return f"[{fired}] compile error: {str(e).splitlines()[0][:160]}"
    row = []
    for size in sorted({lo, lo + 1, (lo + hi) // 2, hi}) if dynamic else [hi]:
        args = x(size, 3 if dynamic else 2)
        try:
            got, expected = _flat(fn(args)), _flat(module(args))
        except Exception:
            row.append(f"{size}:runerr")
            continue
        ok = all(
            g.shape == e.shape and torch.allclose(g.to(e.dtype), e, rtol=1e-4, atol=1e-4) for g, e in zip(got, expected)
        )
        row.append(f"{size}:{'ok' if ok else 'WRONG'}")
    return f"[{fired}] " + " ".join(row)


def main(argv: list[str]) -> int:
    only = argv[0] if argv else ""
    counts = {"raw": [0, 0, 0], "rules": [0, 0, 0]}  # passed, failed, wrong
    for case in cases():
        if only not in case[0]:
            continue
        for dynamic in (False, True):
            for rules in (False, True):
                row = run(case, dynamic, rules)
                label = "rules" if rules else "raw"
                print(f"{case[0]:24s} {'dim' if dynamic else 'static':6s} {label:5s} {row}", flush=True)
                if row.startswith("export error"):
                    continue
                failed = "error" in row or "runerr" in row or "WRONG" in row
                counts[label][0 if not failed else 1] += 1
                counts[label][2] += "WRONG" in row
    for label, (passed, failed, wrong) in counts.items():
        print(f"{label}: {passed} pass, {failed} fail ({wrong} of them wrong numbers)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
