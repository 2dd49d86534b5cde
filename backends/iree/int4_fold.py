"""torchao's int4 g32 linear as the rule leaves it (`fx_rewrites::int4_grouped_linear`), packed at build time.

`rules/int4_decode.py` replaces a decode's `linear(x, dequantize_affine(q, [1, 32], scale, zero, int8, -8, 7))` by
`int4_grouped_linear(x, q, scale, zero)`: one op over the frozen tensors as torchao stores them (eager: torchao's
dequantize, float32, and a matmul), since a rule sees shapes, not values. `fold_int4` (run by
`preparing.prepare_program`, where the values are known) then writes it as `int4_matvec(x, words, scales, ...)`,
the words (`int4_dispatch.pack_words`: eight values an int32) and scales a parameter each, in place of torchao's
int8 values and scales: the module holds half int8's bytes, and no packing runs per call. Where the zero points are
not all 0 (torchao's asymmetric mapping) the op is `asym_int4_matvec` over the zero points packed too
(`int4_dispatch.pack_zeros`). Only values or zero points outside int4's range make the op `linear` over the
dequantized float32 weight (a parameter: correct, 8x the bytes), with a warning.
"""

from __future__ import annotations

import warnings

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

from fx_rewrites.backends.iree.frozen_fold import FrozenWeight, Replaced, fold_frozen, packed
from fx_rewrites.backends.iree.int4_dispatch import (
    ASYM_INT4_MATVEC,
    GROUP,
    INT4_MATVEC,
    pack_scales,
    pack_words,
    pack_zeros,
)
from fx_rewrites.backends.iree.weight_layout import SUFFIX

#: output channels of the kernel's tile (4 x 8 lanes: AVX2's ymm; 8 x 8 spills, section 49)
TILE = 4
#: channel tiles per workgroup (section 49's measured split)
PER = 8
#: the packed parameters' key suffixes (ending in `weight_layout.SUFFIX`: the archive is written as it is)
WORDS, SCALES, ZEROS = ".int4_words" + SUFFIX, ".int4_scales" + SUFFIX, ".int4_zeros" + SUFFIX
#: the packed-tensor memo's name for scales packed beside zero points (not scaled by 2^-28)
ZERO_SCALES = "zero_scales"


def dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """torchao's `dequantize_affine(q, [1, 32], scale, zero)` to float32: (q - zero) * scale per group."""
    n, k = q.shape
    values = q.view(n, k // GROUP, GROUP).to(torch.int32)
    if zero is not None:
        values = values - zero.to(torch.int32).unsqueeze(-1)
    return (values.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).view(n, k)


@torch.library.custom_op("fx_rewrites::int4_grouped_linear", mutates_args=())
def int4_grouped_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, K] @ dequantized(q, scale, zero).T: torchao's int4 g32 linear, before `fold_int4` packs it."""
    return x @ dequantized(q, scale, zero).t()


@int4_grouped_linear.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


INT4_GROUPED_LINEAR = torch.ops.fx_rewrites.int4_grouped_linear.default


def _words(weight: FrozenWeight) -> Replaced:
    return weight.q, WORDS, packed(weight.qv, WORDS, lambda t: pack_words(t, TILE))


def _rewrite(graph: Graph, node: Node, weight: FrozenWeight) -> tuple[Node, list[Replaced]]:
    x, n = node.args[0], weight.qv.shape[0]
    if weight.symmetric_int4():
        scales = (weight.scale, SCALES, packed(weight.sv, SCALES, lambda t: pack_scales(t, TILE)))
        return graph.call_function(INT4_MATVEC, (x, weight.q, weight.scale, n, TILE, PER)), [_words(weight), scales]
    if weight.zero is not None and all(int(t.min()) >= -8 and int(t.max()) <= 7 for t in (weight.qv, weight.zv)):
        # torchao's asymmetric mapping: (q - z) in int32, the scales as they are
        scales = (weight.scale, SCALES, packed(weight.sv, ZERO_SCALES, lambda t: pack_scales(t, TILE, 1.0)))
        zeros = (weight.zero, ZEROS, packed(weight.zv, ZEROS, lambda t: pack_zeros(t, TILE)))
        args = (x, weight.q, weight.scale, weight.zero, n, TILE, PER)
        return graph.call_function(ASYM_INT4_MATVEC, args), [_words(weight), scales, zeros]
    warnings.warn(
        f"{weight.name}: int4 values or zero points outside [-8, 7]: the int4 dispatch cannot hold them, so this "
        "linear reads a float32 copy of the dequantized weight (8x its bytes)",
        stacklevel=4,
    )
    new = graph.call_function(torch.ops.aten.linear.default, (x, weight.q))
    return new, [(weight.q, ".int4_dequantized" + SUFFIX, dequantized(weight.qv, weight.sv, weight.zv))]


def fold_int4(program: ExportedProgram) -> ExportedProgram:
    """`program` (a private copy: `prepare_program`'s) with each `int4_grouped_linear` over frozen tensors written
    as `int4_matvec` over packed words and scales, or, where the zero points are not all 0, `asym_int4_matvec`
    over the zero points packed too; the placeholders become the packed parameters (their keys end in `WORDS`,
    `SCALES`, `ZEROS`), all-zero zero points' go."""
    return fold_frozen(program, INT4_GROUPED_LINEAR, slice(1, 4), _rewrite)
