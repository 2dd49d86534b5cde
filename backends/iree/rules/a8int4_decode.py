"""torchao's int8-activation x int4 g32 linear, in a decode, through the integer a8 int4 dispatch (issue 33).

`Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))` exports
`linear(dequantize_affine(qx, [1, .., K], sx, zx, int8, -128, 127), dequantize_affine(q, [1, 32], scale, zero, int8,
-8, 7))`, qx = `quantize_affine(x, ...)` per token with `choose_qparams_affine`'s scale and zero point. Where x has
at most `DECODE_ROWS` rows, this rule writes `a8int4_grouped_linear(qx, sx, zx, q, scale, zero)` (`a8int4_fold.py`)
over x's int8 values, which the backend packs into `a8int4_matvec` (`a8int4_dispatch.py`: int8 x int4 products
summed in integers by `vpmaddubsw`, llama.cpp Q4_0's scheme) when the module is built. It runs before
`int4_decode_as_dispatch_for_iree`, which would otherwise take the same weight with the float x. AVX2 only.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.a8int4_fold import A8INT4_GROUPED_LINEAR
from fx_rewrites.backends.iree.rules.int4_decode import _int4_decode
from fx_rewrites.backends.iree.rules.quantized_matmul import _never, _OnDequantize
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_tensor
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _x_dequantize(x: Node) -> Miss | None:
    """None where `x` is torchao's per-row int8 dequantize: `dequantize_affine(qx, [1, .., 1, K], sx, zx, int8,
    -128, 127)` to float32, qx int8, sx float32 and zx int8 or int32 of one value a row."""
    target = getattr(x, "target", None)
    if getattr(target, "_opname", None) != "dequantize_affine" or "torchao" not in str(target):
        return Miss("x is not torchao's dequantize_affine (not a dynamically quantized activation)")
    qx, block, sx, zx = x.args[:4]
    shape = list(fake_tensor(qx).shape)
    if fake_tensor(qx).dtype != torch.int8 or list(x.args[4:7]) != [torch.int8, -128, 127]:
        return Miss(f"x is not int8 in [-128, 127] ({list(x.args[4:7])})")
    if len(block) != len(shape) or any(b != 1 for b in block[:-1]) or block[-1] != shape[-1]:
        return Miss(f"x's block {list(block)} is not one row")
    out_dtype = x.kwargs.get("output_dtype", x.args[7] if len(x.args) > 7 else torch.float32)
    if out_dtype != torch.float32 or zx is None:
        return Miss(f"x dequantizes to {out_dtype} (zero point {zx})")
    if fake_tensor(sx).dtype != torch.float32 or fake_tensor(zx).dtype not in (torch.int8, torch.int32):
        return Miss(f"x's scale {fake_tensor(sx).dtype}, zero point {fake_tensor(zx).dtype}")
    return None


def _a8int4_decode(node: Node) -> Miss | tuple[Node, Node | None]:
    """torchao's per-row int8 dequantize of x read by one linear whose weight is an int4 g32 dequantize that
    `int4_decode` would take (a decode step): (that weight dequantize, its zero point or None). Rooted at x's
    dequantize, which comes first in the graph: DEFAULT's lowering of torchao's ops would take it before the weight's
    dequantize is visited."""
    why = _x_dequantize(node)
    if why is not None:
        return why
    users = list(node.users)
    if len(users) != 1 or users[0].target is not aten.linear.default or users[0].args[0] is not node:
        return Miss("x's dequantize is read by something other than one linear's input")
    weight = users[0].args[1]
    if getattr(getattr(weight, "target", None), "_opname", None) != "dequantize_affine":
        return Miss("the linear's weight is not torchao's dequantize_affine")
    zero = _int4_decode(weight)
    if isinstance(zero, Miss):
        return zero
    return weight, zero


@rule(
    roots=(_never,),
    when=_a8int4_decode,
    priority=30,  # before DEFAULT's lowering of x's dequantize
    tags={"iree", "quantized", "performance"},
    doc=(
        "torchao's int8-activation x int4 g32 linear with at most 2 rows (a decode step) becomes "
        "`a8int4_grouped_linear` over x's int8 values, which the IREE backend packs (two values a byte, "
        "each group's scale and sum) and runs through a hand-written dispatch summing int8 x int4 in integers "
        "(`vpmaddubsw`: llama.cpp Q4_0's scheme) on AVX2."
    ),
)
def a8int4_decode_as_dispatch_for_iree(node: Node, rw: Rewriter, *, found: tuple[Node, Node | None]) -> None:
    weight, zero = found
    q, scale = weight.args[0], weight.args[2]
    qx, sx, zx = node.args[0], node.args[2], node.args[3]

    (linear,) = weight.users
    bias = linear.args[2] if len(linear.args) > 2 else None
    shape, k = list(fake_tensor(qx).shape), fake_tensor(qx).shape[-1]
    # rows and the output's sizes read from qx (x's dequantize is the root: nothing may read it before it)
    sizes = [s if isinstance(s, int) else rw.size(qx, d) for d, s in enumerate(shape[:-1])]
    rows = sizes[0]
    for size in sizes[1:]:
        rows = rows * size if isinstance(rows, int) and isinstance(size, int) else rw.call(operator.mul, rows, size)
    flat = rw.call(aten.view.default, qx, [rows, k])
    scales = rw.call(aten.view.default, sx, [rows])
    zeros = rw.call(aten.view.default, zx, [rows])
    if fake_tensor(zx).dtype != torch.int32:
        zeros = rw.call(aten._to_copy.default, zeros, dtype=torch.int32)
    out = rw.call(A8INT4_GROUPED_LINEAR, flat, scales, zeros, q, scale, zero)
    if bias is not None:
        out = rw.call(aten.add.Tensor, out, bias)
    rw.replace(linear, rw.call(aten.view.default, out, [*sizes, fake_tensor(q).shape[0]]))
    rw.erase(weight)
    rw.erase(node)


a8int4_decode_for_iree = _OnDequantize(a8int4_decode_as_dispatch_for_iree)

RULES = RuleSet([a8int4_decode_for_iree], name="iree-a8int4-decode")
