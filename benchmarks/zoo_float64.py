"""How far torch float32 and IREE are from float64, for zoo rows with a widened tolerance (issue 27).

A zoo row's float32 tolerance may not be wider than torch's own float32 error: this measures both against
the same model run in float64 (the model and inputs `.double()`), on the row's input sets, on the export
route and the torch.compile route. Per route and seed: the largest absolute error of torch float32 and of
IREE against float64, IREE's largest difference from eager float32, and how many outputs of each lie outside
the zoo's default float32 tolerance (rtol 1e-4, atol 1e-5) from float64.

    python benchmarks/zoo_float64.py [ROW ...]   # default: data2vec_audio mobilenet_v3_large mnasnet0_5
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.zoo from a checkout
os.environ["FX_REWRITES_IREE_CACHE"] = "off"
os.environ["FX_REWRITES_STRICT"] = "1"  # a graph on eager would measure torch, not IREE

import torch
from torch.utils import _pytree as pytree

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.dynamo import dynamo_backend
from tests.zoo import registry

ROWS = ("data2vec_audio", "mobilenet_v3_large", "mnasnet0_5")


def _floats(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.cat([t.detach().double().flatten() for t in leaves])


def _double(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def _outside(got: torch.Tensor, exact: torch.Tensor) -> int:
    return int(((got - exact).abs() > 1e-5 + 1e-4 * exact.abs()).sum())


def measure(name: str) -> None:
    entry = registry.BY_NAME[name]
    model = entry.model()
    model64 = copy.deepcopy(model).double()
    iree = backends.get("iree")
    args0, kwargs0 = entry.inputs(registry.SEEDS[0])
    with torch.no_grad():
        program = torch.export.export(model, args0, kwargs0 or None)
        exported = iree.compile(fx_rewrites.apply(program, iree.rules).program, args0)
        torch._dynamo.reset()
        dynamo = torch.compile(model, backend=dynamo_backend(iree), dynamic=False)
        for seed in registry.SEEDS:
            args, kwargs = entry.inputs(seed)
            eager = _floats(model(*args, **kwargs))
            exact = _floats(model64(*_double(args), **_double(kwargs)))
            torch_err = (eager - exact).abs().max().item()
            for route, fn in (("export", exported), ("compile", dynamo)):
                got = _floats(fn(*args, **kwargs))
                print(
                    f"| {name} | {route} | {seed} | {torch_err:.2e} ({_outside(eager, exact)}) | "
                    f"{(got - exact).abs().max().item():.2e} ({_outside(got, exact)}) | "
                    f"{(got - eager).abs().max().item():.2e} | {exact.abs().max().item():.3g} | {exact.numel()} |",
                    flush=True,
                )
        torch._dynamo.reset()


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    print("| row | route | seed | torch f32 vs f64 (outside) | IREE vs f64 (outside) | IREE vs eager | max abs | n |")
    print("|---|---|---|---|---|---|---|---|")
    for name in argv or ROWS:
        measure(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
