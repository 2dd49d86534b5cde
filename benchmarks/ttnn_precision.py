"""Where a model's difference from eager comes from on the ttnn path: device arithmetics simulated on the host.

    python benchmarks/ttnn_precision.py [--models mobilenet_v2,resnet] [--seeds 0,1]

Per zoo model and input seed: the worst element's |got - eager| over the
backend's tolerance, 3e-2 + 3e-2 * |eager| (1 or less passes rtol = atol =
3e-2), for each of these arithmetics (the lowered graph runs with each
stand-in's torch body, as `emulate=True` does; no ttnn involved):

- `bf16`: the lowered graph, every device result rounded to bfloat16 (what
  the test double gives); `bf16 unfolded`: the same without the fold phase;
- `fp32`: the lowered graph with bfloat16 replaced by float32 (a FLOAT32
  device dtype with IEEE arithmetic; factories' `arange`/`full` stay
  bfloat16, exact for the small integers they hold);
- `fp32 tf32-mm`: float32, with every convolution's and matmul's operands
  rounded to TF32 (10 explicit mantissa bits: the widest operand the Tensix
  matrix engine takes, per tt-metal's "Achieving FP32 Accuracy" notes);
  `... unfolded`: the same without the fold phase;
- `eager bf16-in` / `eager tf32-in`: the model itself in float32 on its input
  rounded to bfloat16 / TF32, nothing else rounded (what `from_torch` alone
  costs).

Prints a Markdown table. Timings are not measured here.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.* from a checkout

import attrs
import torch
from torch.utils import _pytree as pytree

from fx_rewrites import apply, backends
from fx_rewrites.backends.ttnn import lower
from fx_rewrites.backends.ttnn.rules import RULES, ops, ops_extra
from fx_rewrites.rules import DEFAULT
from fx_rewrites.ruleset import Phases

TOL = 3e-2


def tf32(t: torch.Tensor) -> torch.Tensor:
    """`t` (float32) rounded to nearest even at 10 explicit mantissa bits."""
    if t.dtype != torch.float32:
        return t
    bits = t.contiguous().view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & -8192
    return torch.where(t.isfinite(), rounded.view(torch.float32), t)


@contextlib.contextmanager
def _tf32_operands() -> Iterator[None]:
    """The stand-ins' convolutions and matmuls (`F.conv2d`, `torch.matmul` in their bodies) take TF32 operands;
    attention (`F.scaled_dot_product_attention`) is left in float32."""
    conv2d, matmul = torch.nn.functional.conv2d, torch.matmul

    def conv(x: torch.Tensor, w: torch.Tensor, *rest: Any, **kw: Any) -> torch.Tensor:
        return conv2d(tf32(x), tf32(w), *rest, **kw)

    torch.nn.functional.conv2d = conv
    torch.matmul = lambda a, b, **kw: matmul(tf32(a), tf32(b), **kw)
    try:
        yield
    finally:
        torch.nn.functional.conv2d, torch.matmul = conv2d, matmul


@contextlib.contextmanager
def _float32_device() -> Iterator[None]:
    """Stand-in bodies keep float32 where they round to bfloat16."""
    saved = ops._round, ops_extra._round, ops.DEVICE_DTYPES["bfloat16"]

    def keep(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32 if x.is_floating_point() else x.dtype, copy=True)

    ops._round = ops_extra._round = keep
    ops.DEVICE_DTYPES["bfloat16"] = torch.float32
    try:
        yield
    finally:
        ops._round, ops_extra._round, ops.DEVICE_DTYPES["bfloat16"] = saved


def _worst(got: Any, expected: Any) -> float:
    pairs = [
        (g.float(), e.float())
        for g, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected))
        if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel()
    ]
    return max((((g - e).abs() / (TOL + TOL * e.abs())).max().item() for g, e in pairs), default=0.0)


def measure(entry: Any, seed: int) -> dict[str, float]:
    module = entry.model()
    args, kwargs = entry.inputs(seed)
    args = tuple(args)
    program = torch.export.export(module, args, kwargs or None)
    backend = attrs.evolve(backends.get("ttnn"), emulate=True)
    folded = backend.compile(lower(program), args)
    first = apply(program, DEFAULT)
    plain = apply(first.program, Phases(RULES, name="ttnn unfolded"))
    unfolded = backend.compile(plain.program, args)
    with torch.no_grad():
        expected = module(*args, **kwargs)
        out = {"bf16": _worst(folded(*args, **kwargs), expected)}
        out["bf16 unfolded"] = _worst(unfolded(*args, **kwargs), expected)
        with _float32_device():
            out["fp32"] = _worst(backend.compile(lower(program), args)(*args, **kwargs), expected)
            with _tf32_operands():
                out["fp32 tf32-mm"] = _worst(backend.compile(lower(program), args)(*args, **kwargs), expected)
                out["fp32 tf32-mm unfolded"] = _worst(backend.compile(plain.program, args)(*args, **kwargs), expected)
        for name, rounding in (("eager bf16-in", lambda t: t.to(torch.bfloat16).float()), ("eager tf32-in", tf32)):
            rounded = tuple(rounding(a) if a.is_floating_point() else a for a in args)
            out[name] = _worst(module(*rounded, **kwargs), expected)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mobilenet_v2", help="comma-separated zoo names")
    p.add_argument("--seeds", default="0,1", help="indices into the zoo's SEEDS")
    opts = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    from tests.zoo import registry

    columns: list[str] = []
    lines = []
    for name in opts.models.split(","):
        for index in (int(s) for s in opts.seeds.split(",")):
            seed = registry.SEEDS[index]
            result = measure(registry.BY_NAME[name], seed)
            columns = columns or list(result)
            lines.append(f"| {name} | {seed} | " + " | ".join(f"{result[c]:.2f}" for c in columns) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    print("| model | seed | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
