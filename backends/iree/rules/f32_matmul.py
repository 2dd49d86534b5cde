"""A float32 linear through the hand-written 6x16 matmul dispatch (issue 32; llvm-cpu, AVX2).

    linear(x, W, b)   # x [..., K] over M rows (static), W [N, K] the program's own, N % 16 == 0
    -> f32_matmul(x.reshape(M, K), pack(W), N, 2, PER) + b, viewed [..., N]

IREE 3.13 compiles every AVX2 float32 product to one 8x8x1 inner loop (one load and 8 broadcasts per 8 FMAs,
whatever its flags or tuning specs: docs/iree-3.13-findings.md section 50); `f32_dispatch.py`'s kernel keeps a 6x16
block in 12 accumulators (2 loads and 6 broadcasts per 12 FMAs) with the weight laid out [N/16, K, 16]. Alone on real
Zen 3 it ran the linear 1024 -> 1024 over 128 rows and ViT's MLP products in 0.57-0.62 of IREE's time
(benchmarks/f32_dispatch.py); in the models, locked, the route without / with the rule read ViT 1.41, BERT 1.32, Llama
1.25, the Whisper encoder 1.32 (docs/performance.md, "A float32 matmul kernel of our own on AVX2"). The weight's
layout is a view and permute of the weight in the graph: for the program's own weight IREE evaluates it once (at
compile time or in the module's initializer), so the rule takes only such a weight (`conv_taps.constant_weight`).
The kernel is static in its rows: a `Dim` row count stays IREE's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.f32_dispatch import F32_MATMUL, KU, NR, PER
from fx_rewrites.backends.iree.rules.conv_taps import constant_weight
from fx_rewrites.backends.iree.rules.mlp_tiles import linear_args
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: the fewest rows taken: the kernel was measured from 128 rows (a decode's few rows read the whole weight per row:
#: IREE's matvec forms)
MIN_ROWS = 64


def _f32_linear(node: Node) -> dict[str, Any] | Miss:
    x, w, b = linear_args(node)
    if not constant_weight(w):
        return Miss("the weight is not the program's own: its layout would be rewritten at every call")
    xv, wv = fake_value(x), fake_value(w)
    if xv.dtype != torch.float32 or wv.dtype != torch.float32:
        return Miss(f"{xv.dtype} x {wv.dtype}: the kernel is float32")
    if b is not None and (not isinstance(b, Node) or fake_value(b).dtype != torch.float32):
        return Miss("a bias that is not a float32 tensor")
    if xv.dim() < 2 or wv.dim() != 2:
        return Miss(f"x of rank {xv.dim()}, a weight of rank {wv.dim()}")
    if not all(isinstance(s, int) for s in xv.shape):
        return Miss("a Dim in x's sizes: the kernel is static in its rows")
    n, k = wv.shape
    rows = xv.shape[:-1].numel()
    if n % NR or k % KU:
        return Miss(f"{k} -> {n}: N a multiple of {NR}, K of {KU}")
    if rows < MIN_ROWS:
        return Miss(f"{rows} rows (from {MIN_ROWS})")
    return {"x": x, "w": w, "b": b, "rows": rows, "n": n, "k": k, "lead": list(xv.shape[:-1])}


@rule(
    roots=(aten.linear.default,),
    when=_f32_linear,
    priority=2,  # before mlp_rows_padded_to_tiles: the kernel takes ViT's 788 rows as they are
    tags={"iree", "performance"},
    doc=(
        "A float32 linear over a static number of rows (at least 64) with a weight the program holds, N a multiple "
        "of 16, becomes the hand-written 6x16 matmul dispatch (`fx_rewrites::f32_matmul`) over the weight laid out "
        "[N/16, K, 16], the bias added after: on AVX2 IREE 3.13's own product is an 8x8x1 kernel."
    ),
)
def linear_as_f32_dispatch(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    n, k, rows = found["n"], found["k"], found["rows"]
    flat = rw.call(aten.reshape.default, found["x"], [rows, k])
    strips = rw.call(aten.reshape.default, found["w"], [n // NR, NR, k])
    packed = rw.call(aten.permute.default, strips, [0, 2, 1])  # [N/16, K, 16]
    packed = rw.call(aten.reshape.default, packed, [n * k])  # a copy: the strips contiguous
    y = rw.call(F32_MATMUL, flat, packed, n, 2, PER)
    if found["b"] is not None:
        y = rw.call(aten.add.Tensor, y, found["b"])
    rw.replace(node, rw.call(aten.reshape.default, y, [*found["lead"], n]))


RULES = (linear_as_f32_dispatch,)
