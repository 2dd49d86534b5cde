"""How far torch float32 and the project's programs are from float64: float noise told from faults (issues 27, 36).

A zoo row's float32 tolerance may not be wider than torch's own float32 error, and a result at the edge of
the tolerance is judged against the exact one: this measures both against the same model run in float64
(`tests/zoo/float64.py`: the model and inputs `.double()`, float64 as the default dtype), on the row's input
sets, per route: `export` (IREE after the rules), `compile` (torch.compile with the IREE backend) and
`rewritten` (the rewritten program run by torch). Per route, seed and output: the largest absolute error of
torch float32 against float64 (in brackets, how many outputs lie outside the zoo's default float32 tolerance,
rtol 1e-4 atol 1e-5, from float64), torch's band (its largest error over the input and PERTURBATIONS
neighbours within an ulp: tests/zoo/float64.py), the route's error against float64, its ratio to torch's
error and to the band, the route's largest difference from eager (with how many outputs lie outside that
tolerance from eager), and the verdict the zoo tests give: `noise` where the ratio to the band is at most
FLOAT64_K, else `FAULT` (localize the op: fx_rewrites.localize).

    python benchmarks/zoo_float64.py [ROW ...] [--routes export,compile,rewritten]
    # default rows: data2vec_audio mobilenet_v3_large mnasnet0_5; ROW: a zoo row or one of EXTRA
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.zoo from a checkout
os.environ["FX_REWRITES_IREE_CACHE"] = "off"
os.environ["FX_REWRITES_STRICT"] = "1"  # a graph on eager would measure torch, not IREE

import torch

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.dynamo import dynamo_backend
from tests.zoo import registry, torchvision_cpu
from tests.zoo.float64 import FLOAT64_K, reference
from tests.zoo.spec import build, leaves

ROWS = ("data2vec_audio", "mobilenet_v3_large", "mnasnet0_5")
ROUTES = ("export", "compile", "rewritten")


def _outside(got: torch.Tensor, exact: torch.Tensor) -> int:
    return int(((got - exact).abs() > 1e-5 + 1e-4 * exact.abs()).sum())


class RaftSmall(torch.nn.Module):
    """torchvision's RAFT (small), random weights: two 128x128 images (its least size), the flow after each of
    `updates` refinements."""

    def __init__(self, updates: int = 12) -> None:
        super().__init__()
        torchvision_cpu.install()
        import torchvision

        self.raft = torchvision.models.optical_flow.raft_small(weights=None)
        self.updates = updates

    def forward(self, image1: torch.Tensor, image2: torch.Tensor) -> list[torch.Tensor]:
        return self.raft(image1, image2, num_flow_updates=self.updates)


@contextlib.contextmanager
def raft_coords_in_default_dtype() -> Iterator[None]:
    """RAFT's coordinate grid in the default dtype: torchvision makes it with `.float()`, which no float64 run
    can take (grid_sample: "expected scalar type Double but found Float"); float32 runs are unchanged."""
    from torchvision.models.optical_flow import raft

    def make_coords_grid(batch_size: int, h: int, w: int, device: str = "cpu") -> torch.Tensor:
        ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        return torch.stack((xs, ys)).to(torch.get_default_dtype())[None].repeat(batch_size, 1, 1, 1)

    original = raft.make_coords_grid
    raft.make_coords_grid = make_coords_grid
    try:
        yield
    finally:
        raft.make_coords_grid = original


def _raft_inputs(seed: int) -> registry.Inputs:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 3, 128, 128, generator=g), torch.randn(1, 3, 128, 128, generator=g)), {}


def _raft() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return RaftSmall().eval()


def _mobilevitv2_wide() -> torch.nn.Module:
    """The zoo's MobileViTV2 at width 0.5, norms not calibrated: 1,024 outputs on one image, like issue 36's."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = {"image_size": 64, "width_multiplier": 0.5, "initializer_range": 0.2}
        return build("transformers", "MobileViTV2Model", config).eval()


def _one_image(seed: int) -> registry.Inputs:
    return (torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(seed)),), {}


#: rows outside the zoo: name -> (model, inputs(seed), a context the runs need)
EXTRA: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], registry.Inputs], Callable[[], Any]]] = {
    "raft_small": (_raft, _raft_inputs, raft_coords_in_default_dtype),
    "mobilevitv2_wide": (_mobilevitv2_wide, _one_image, contextlib.nullcontext),
}


def _row(name: str) -> tuple[torch.nn.Module, Callable[[int], registry.Inputs], Callable[[], Any]]:
    if name in EXTRA:
        make, inputs, context = EXTRA[name]
        return make(), inputs, context
    entry = registry.BY_NAME[name]
    return entry.model(), entry.inputs, contextlib.nullcontext


def _routes(model: torch.nn.Module, args0: tuple, kwargs0: dict, routes: list[str]) -> dict[str, Callable]:
    iree = backends.get("iree")
    made: dict[str, Callable] = {}
    if "export" in routes or "rewritten" in routes:
        rewritten = fx_rewrites.apply(torch.export.export(model, args0, kwargs0 or None), iree.rules).program
        if "export" in routes:
            made["export"] = iree.compile(rewritten, args0)
        if "rewritten" in routes:
            made["rewritten"] = rewritten.module()
    if "compile" in routes:
        torch._dynamo.reset()
        made["compile"] = torch.compile(model, backend=dynamo_backend(iree), dynamic=False)
    return made


def measure(name: str, routes: list[str], seeds: tuple[int, ...]) -> list[float]:
    """Print the row's lines; return the ratios (route vs float64 / torch's band) of its float outputs."""
    model, inputs, context = _row(name)
    ratios = []
    with context(), torch.no_grad():
        args0, kwargs0 = inputs(seeds[0])
        made = _routes(model, args0, kwargs0, routes)
        for seed in seeds:
            args, kwargs = inputs(seed)
            eager = leaves(model(*args, **kwargs))
            ref = reference(model, args, kwargs, flatten=leaves)
            for route, fn in made.items():
                got = leaves(fn(*args, **kwargs))
                for i, (e, x, band, g) in enumerate(zip(eager, ref.exact, ref.torch_error, got, strict=True)):
                    if band is None:
                        continue
                    e, g = e.double().flatten(), g.double().flatten()
                    x = x.flatten()
                    torch_err, err = (e - x).abs().max().item(), (g - x).abs().max().item()
                    ratio = err / band if band else (0.0 if err == 0 else float("inf"))
                    ratios.append(ratio)
                    print(
                        f"| {name} | {route} | {seed} | {i} | {torch_err:.2e} ({_outside(e, x)}) | {band:.2e} | "
                        f"{err:.2e} ({_outside(g, x)}) | {err / torch_err if torch_err else 0:.2f} | {ratio:.2f} | "
                        f"{(g - e).abs().max().item():.2e} ({_outside(g, e)}) | {x.abs().max().item():.3g} | "
                        f"{x.numel()} | {'noise' if ratio <= FLOAT64_K else 'FAULT'} |",
                        flush=True,
                    )
    torch._dynamo.reset()
    return ratios


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", default=list(ROWS))
    parser.add_argument("--routes", default="export,compile", help=f"comma-separated, of {', '.join(ROUTES)}")
    parser.add_argument("--seeds", type=int, default=len(registry.SEEDS), help="input sets 0..N-1")
    options = parser.parse_args(argv)
    routes = options.routes.split(",")
    assert set(routes) <= set(ROUTES), f"--routes: {routes}, expected some of {ROUTES}"
    warnings.simplefilter("ignore")
    print(
        "| row | route | seed | output | torch f32 vs f64 (outside) | torch's band | route vs f64 (outside) | "
        "/ torch | / band | route vs eager (outside) | max abs | n | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = [r for name in options.rows for r in measure(name, routes, tuple(range(options.seeds)))]
    print(f"largest ratio to torch's band {max(ratios):.2f} (float noise up to FLOAT64_K = {FLOAT64_K})")
    return 0 if max(ratios) <= FLOAT64_K else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
