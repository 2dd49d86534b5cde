"""Float arguments IREE 3.13 must round to float32 on the host, where its VM cannot: `arange` and nearest
upsampling.

torch-mlir lowers `aten.arange` with float bounds or step, and nearest upsampling with scale factors, by
computing in float64 and truncating to float32 outside any kernel; MLIR folds `arith.truncf` of a constant
only when the float32 value is exact, and the VM has no float64-to-float32 truncation: "failed to legalize
operation 'arith.truncf' that was explicitly marked illegal" for `torch.arange(0.0, -3.0, -0.3)` or
`F.interpolate(x, scale_factor=1.7)` (a step or scale that float32 holds exactly, -0.5 or 2.0, compiles).

- arange with a start or step float32 does not hold (an inexact end only sets the length, which export
  computed): `start + step * i` computed in float64 over an int64 `i`, then rounded, as torch's CPU kernel does
  (its accumulation type for float32 is float64): the same values bit for bit.
- nearest upsampling: torch's own decomposition (index arithmetic on an arange, then a gather), where the
  scale is a float32 constant inside a kernel. With Dim-sized maps the output size is `floor(h * scale)`,
  which needs `sym_float` (the importer has none): `refusals.py` names that form instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import Decompose, rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
#: nearest upsampling with scale factors (`.vec`: F.interpolate's form) or scales (`.default`: aot's), in the ranks
#: IREE lowers (3-d and nearest-exact have no lowering: the legalize phase decomposes them)
NEAREST = (
    aten.upsample_nearest1d.vec,
    aten.upsample_nearest2d.vec,
    aten.upsample_nearest1d.default,
    aten.upsample_nearest2d.default,
)


def inexact_in(value: Any, dtype: torch.dtype) -> bool:
    """A Python float that `dtype` does not hold exactly (0.3 in float32)."""
    if not isinstance(value, float) or value != value or value in (float("inf"), float("-inf")):
        return False
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).item()) != value


def _float_arange(node: Node, *, args: Mapping[str, Any]) -> int | Miss:
    """The length of an arange of float32 (or a half type) with a start or step float32 does not hold."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point or out.dtype == torch.float64:
        return Miss("not a float32 or half-precision arange (float64 compiles; integers are not rounded)")
    if not all(isinstance(args.get(name, 0), (int, float)) for name in ("start", "step")):
        return Miss("a symbolic start or step")
    if not any(inexact_in(args.get(name), out.dtype) for name in ("start", "step")):
        return Miss(f"start and step are exact in {out.dtype} (an inexact end compiles: it only sets the length)")
    length = out.shape[0]
    if not isinstance(length, int):
        return Miss("a symbolic length (refusals.py names the form)")
    return length


@rule(
    roots=ARANGES,
    when=_float_arange,
    tags={"iree"},
    doc=(
        "A float32 arange whose start or step float32 does not hold exactly (`torch.arange(0.0, -3.0, "
        "-0.3)`) computed as start + step * i in float64 over an int64 i, then rounded, as torch's kernel does. "
        "IREE 3.13: \"failed to legalize operation 'arith.truncf' that was explicitly marked illegal\" (the "
        "host truncation of a float64 it cannot fold)."
    ),
)
def float_arange_in_float64_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any], found: int) -> Any:
    out = node.meta["val"]
    index = rw.call(aten.arange.default, found, dtype=torch.int64, device=out.device)
    wide = rw.call(aten._to_copy.default, index, dtype=torch.float64)
    start, step = float(args.get("start", 0.0)), float(args.get("step", 1.0))
    values = rw.call(aten.add.Tensor, rw.call(aten.mul.Tensor, wide, step), start)
    rw.replace(node, rw.call(aten._to_copy.default, values, dtype=out.dtype))


def scales_of(node: Node, args: Mapping[str, Any]) -> list[float]:
    """The float scales a nearest upsample reads (`scale_factors`, or `scales_h`/`scales_w`/`scales_d`)."""
    if "scale_factors" in args:
        return [s for s in (args["scale_factors"] or []) if isinstance(s, float)]
    return [args[name] for name in ("scales", "scales_d", "scales_h", "scales_w") if isinstance(args.get(name), float)]


def spatial_sizes_static(value: torch.Tensor) -> bool:
    """The map's sizes (every dim after batch and channels) are ints; a Dim batch is fine."""
    return all(isinstance(s, int) for s in value.shape[2:])


def _inexact_nearest(node: Node, *, args: Mapping[str, Any]) -> bool | Miss:
    x = args["input"] if "input" in args else args["self"]
    val = x.meta.get("val")
    scales = scales_of(node, args)
    if not any(inexact_in(s, torch.float32) for s in scales):  # 3.0 compiles: the scale itself is truncated
        return Miss(f"no scale factor float32 misses ({scales}): IREE compiles it")
    if not spatial_sizes_static(node.meta["val"]) or not spatial_sizes_static(val):
        return Miss("a Dim-sized map: floor(h * scale) needs sym_float (refusals.py names the form)")
    return True


decompose_inexact_nearest_for_iree = Decompose(
    name="decompose_inexact_nearest_for_iree",
    ops=NEAREST,
    when=_inexact_nearest,
    tags={"iree"},
    doc=(
        "Nearest upsampling with a scale factor float32 does not hold (`F.interpolate(x, scale_factor=1.7)`, "
        "0.6) replaced by torch's decomposition (an arange times the scale, floored, then a gather), on static "
        "sizes. IREE 3.13: \"failed to legalize operation 'arith.truncf' that was explicitly marked illegal\"."
    ),
)


RULES = RuleSet([float_arange_in_float64_for_iree, decompose_inexact_nearest_for_iree], name="iree-float-scalars")
