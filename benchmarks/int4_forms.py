"""Forms of one grouped int4 matvec on IREE (issue 33): which one reads the fewest bytes fastest.

    python benchmarks/int4_forms.py                     # 2816 x 1024, one row, group 32
    python benchmarks/int4_forms.py --rows 16 --forms f32,int4_packed_two

One weight [N, K] times one row x [rows, K], each form a small module whose weights are already laid out as the
form reads them (what `weight_layout` folds at build time), exported, imported like the backend does, compiled
with the backend's flags, its performance flags and `--iree-dispatch-creation-enable-aggressive-fusion`, and timed
by `iree-benchmark-module` (`local-sync`: one thread, median CPU time of the repetitions). Forms:

- `f32`: `linear(x, w)` on a float32 weight (what the float32 route runs; data-tiled).
- `int8_blocked`: int8 per channel, [N/16, K, 16] blocks, the conversion inside one reduction.
- `int4_unpacked_two`: the int4 values one per int8 byte (torchao's storage), [N/16, G, 32, 16] blocks; per-group
  partial sums, then the zero point's share and the scale, then the groups (two reductions).
- `int4_packed_two`: the same with two values per byte (the group's first 16 in the low nibble, its last 16 in
  the high one, stored offset by 8 so both unpack with `&` and `>>` only), [N/16, G, 16, 16] bytes.
- `int4_packed_one`, `int4_packed_prescaled`: the packed bytes dequantized inside one reduction over (groups, pairs).
- `int4_packed_shifts(_one)`: both nibbles from one shift by [0, 4] over a broadcast of the bytes.
- `int4_gmajor`: one value per byte laid out [G, N/16, group, 16], z * s precomputed.
- `int4_groups_last`: the second stage over scales in their [N, G] layout, the partials transposed to it.
- `int4_halves`: `int4_unpacked_two` with the groups summed by adding halves (what the rule writes).
- `int4_pairs`: the same, each step a sum over an axis of 2.
- `int4_tiles2`, `int4_tiles4`, `int4_tiles8`: `int4_halves` over the weight laid out [N/16, G/t, group, t, 16]
  (t groups' 16 channels side by side at each position of the group), the scaling after a reshape to
  [rows, N/16, G, 16] (its own dispatch).
- `int4_tiles2_fused`, `int4_tiles4_fused` (**what the rule writes**, t = 4): the same, the scaling in the partials'
  own [rows, N/16, G/t, t, 16] shape (fused into the matvec), the groups summed by halves over G/t, then t.
- `int4_position_major`: [N/16, group, G, 16], every group's 16 channels side by side at each position.
- `int4_tiles4_symmetric` (**what the rule writes for symmetric weights**), `int4_tiles4_symmetric_bf16`:
  `int4_tiles4_fused` without the zero point's share (zero points all zero, torchao's default), the scales
  float32 or bfloat16; `int4_tiles4_scaled_one`: the same, the groups summed inside the matvec (x * w * s
  reduced over (G/t, group): no partials written back); `int4_tiles4_partials`: the symmetric form's first
  dispatch alone (the scaled partials its output, not summed). These read q as if its zero points were 0.
- `int4_nibbles_*` (benchmarks/int4_nibbles.py): the same over two values a byte unpacked in the graph, the bytes a
  mutable global.
- `int4_tiles4_i4`: `int4_tiles4_symmetric` reading nibbles: its weight an IREE `i4` global (two values a byte, half
  the bytes), converted by `arith.sitofp` in the matvec (the module text rewritten after the import: `i4_weight`).

IREE hoists the unpacking of packed bytes out of the call (const-eval of inlined weights, const-expr hoisting of
parameters at load), which stores the unpacked values again; `--flags=--iree-opt-const-expr-hoisting=false,
--iree-opt-const-eval=false` measures the packed forms as they would run unpacked per call.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_nibbles import NIBBLE_FORMS, i4_weight, mutable_weight

FUSION = "--iree-dispatch-creation-enable-aggressive-fusion"
BLOCK = 16
MEDIAN = re.compile(r"process_time/real_time_median\s+[\d.]+ (\w+)\s+([\d.]+) (\w+)")
UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def _blocks(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    return w.reshape(n // BLOCK, BLOCK, k).permute(0, 2, 1).contiguous()


def _pack(q: torch.Tensor, group: int) -> torch.Tensor:
    """int4 values q [N, K] in [-8, 7] as bytes [N/16, G, group/2, 16]: the low nibble q[.., j] + 8, the high
    one q[.., j + group/2] + 8."""
    n, k = q.shape
    g = k // group
    u = (q.to(torch.int16) + 8).reshape(n, g, 2, group // 2)
    byte = (u[:, :, 0] | (u[:, :, 1] << 4)).to(torch.uint8).view(torch.int8)  # [N, G, g/2]
    return byte.reshape(n // BLOCK, BLOCK, g, group // 2).permute(0, 2, 3, 1).contiguous()


class F32(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("w", w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w)


class Int8Blocked(torch.nn.Module):
    def __init__(self, q8: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("b", _blocks(q8))
        self.register_buffer("s", scale)
        self.n, self.k = q8.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = x.shape[0]
        prod = x.view(r, 1, self.k, 1) * self.b.to(torch.float32)
        return prod.sum(2).view(r, self.n) * self.s


class Int4UnpackedTwo(torch.nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> None:
        super().__init__()
        n, k = q.shape
        self.n, self.k, self.g, self.group = n, k, k // group, group
        self.register_buffer("b", _blocks(q))
        self.register_buffer("s", _blocks(scale))
        self.register_buffer("z", _blocks(zero))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group = x.shape[0], self.g, self.group
        values = self.b.to(torch.float32).view(self.n // BLOCK, g, group, BLOCK)
        partial = (x.view(r, 1, g, group, 1) * values).sum(3)
        sums = x.view(r, 1, g, group).sum(3, keepdim=True)
        partial = partial - self.z.to(torch.float32) * sums
        return (partial * self.s).sum(2).view(r, self.n)


class Int4PackedTwo(torch.nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> None:
        super().__init__()
        n, k = q.shape
        self.n, self.k, self.g, self.group = n, k, k // group, group
        self.register_buffer("p", _pack(q, group))
        self.register_buffer("s", _blocks(scale))
        self.register_buffer("z", _blocks(zero.to(torch.int16) + 8).to(torch.int16))

    def _halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        low = torch.bitwise_and(self.p, 15).to(torch.float32)
        four = torch.full((), 4, dtype=torch.int8)  # torch-mlir lowers the Tensor form of the shift only
        high = torch.bitwise_and(torch.bitwise_right_shift(self.p, four), 15).to(torch.float32)
        return low, high

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, half = x.shape[0], self.g, self.group // 2
        low, high = self._halves()
        xs = x.view(r, 1, g, 2, half, 1)
        partial = (xs[:, :, :, 0] * low + xs[:, :, :, 1] * high).sum(3)  # [r, N/16, G, 16]
        sums = x.view(r, 1, g, 2 * half).sum(3, keepdim=True)
        partial = partial - self.z.to(torch.float32) * sums
        return (partial * self.s).sum(2).view(r, self.n)


class Int4PackedOne(Int4PackedTwo):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, half = x.shape[0], self.g, self.group // 2
        low, high = self._halves()
        z = self.z.to(torch.float32).view(self.n // BLOCK, g, 1, BLOCK)
        s = self.s.view(self.n // BLOCK, g, 1, BLOCK)
        xs = x.view(r, 1, g, 2, half, 1)
        prod = xs[:, :, :, 0] * ((low - z) * s) + xs[:, :, :, 1] * ((high - z) * s)
        return prod.sum([2, 3]).view(r, self.n)


class Int4PackedPrescaled(Int4PackedTwo):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, half = x.shape[0], self.g, self.group // 2
        low, high = self._halves()
        z = self.z.to(torch.float32).view(self.n // BLOCK, g, 1, BLOCK)
        s = self.s.view(self.n // BLOCK, g, 1, BLOCK)
        xs = x.view(r, 1, g, 2, half, 1)
        prod = (xs[:, :, :, 0] * (low - z) + xs[:, :, :, 1] * (high - z)) * s
        return prod.sum([2, 3]).view(r, self.n)


class Int4PackedShifts(Int4PackedTwo):
    """Both nibbles from one elementwise op over a broadcast of the bytes: shift by [0, 4] then & 15."""

    def _values(self) -> torch.Tensor:
        shifts = (torch.arange(2).view(2, 1, 1) * 4).to(torch.int8)
        nibbles = torch.bitwise_and(torch.bitwise_right_shift(self.p.unsqueeze(2), shifts), 15)
        return nibbles.to(torch.float32).view(self.n // BLOCK, self.g, self.group, BLOCK)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group = x.shape[0], self.g, self.group
        partial = (x.view(r, 1, g, group, 1) * self._values()).sum(3)
        sums = x.view(r, 1, g, group).sum(3, keepdim=True)
        partial = partial - self.z.to(torch.float32) * sums
        return (partial * self.s).sum(2).view(r, self.n)


class Int4PackedShiftsOne(Int4PackedShifts):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group = x.shape[0], self.g, self.group
        z = self.z.to(torch.float32).view(self.n // BLOCK, g, 1, BLOCK)
        s = self.s.view(self.n // BLOCK, g, 1, BLOCK)
        return (x.view(r, 1, g, group, 1) * ((self._values() - z) * s)).sum([2, 3]).view(r, self.n)


class Int4GroupMajor(torch.nn.Module):
    """int4 values one per byte laid out [G, N/16, group, 16] (groups outermost), scales [G, N/16, 16] and the
    zero points' share z * s precomputed: per-group partials [rows, G, N/16, 16], then scaled and summed over G
    (the outer axis: a sum of contiguous rows)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> None:
        super().__init__()
        n, k = q.shape
        self.n, self.k, self.g, self.group = n, k, k // group, group
        g = k // group
        blocked = _blocks(q).view(n // BLOCK, g, group, BLOCK).permute(1, 0, 2, 3).contiguous()
        self.register_buffer("b", blocked)
        self.register_buffer("s", scale.t().contiguous().view(g, n // BLOCK, BLOCK))
        self.register_buffer("zs", (zero.float() * scale).t().contiguous().view(g, n // BLOCK, BLOCK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group = x.shape[0], self.g, self.group
        partial = (x.view(r, g, 1, group, 1) * self.b.to(torch.float32)).sum(3)  # [r, G, N/16, 16]
        sums = x.view(r, g, group).sum(2).view(r, g, 1, 1)
        return (partial * self.s - self.zs * sums).sum(1).view(r, self.n)


class Int4GroupsLast(Int4UnpackedTwo):
    """As `int4_unpacked_two`, the second stage over scales and zero points in their natural [N, G] layout
    (groups innermost): the partials transposed to [rows, N/16, 16, G] before it."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> None:
        super().__init__(q, scale, zero, group)
        self.s = scale.contiguous()
        self.z = zero.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group = x.shape[0], self.g, self.group
        values = self.b.to(torch.float32).view(self.n // BLOCK, g, group, BLOCK)
        partial = (x.view(r, 1, g, group, 1) * values).sum(3).permute(0, 1, 3, 2).reshape(r, self.n, g)
        sums = x.view(r, 1, g, group).sum(3)
        return ((partial - self.z.to(torch.float32) * sums) * self.s).sum(2)


def _sum_by_halves(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` summed over `dim` by adding halves (an odd one out added alone): elementwise adds IREE fuses into one
    dispatch, in place of a reduction over a strided axis."""
    while t.shape[dim] > 1:
        size = t.shape[dim]
        half = size // 2
        low, high = t.narrow(dim, 0, half), t.narrow(dim, half, half)
        summed = low + high
        t = torch.cat([summed, t.narrow(dim, 2 * half, 1)], dim) if size % 2 else summed
    return t.squeeze(dim)


def _sum_by_pairs(t: torch.Tensor, dim: int) -> torch.Tensor:
    """As `_sum_by_halves`, each step a sum over an axis of 2 (the halves side by side)."""
    while t.shape[dim] > 1:
        size = t.shape[dim]
        half = size // 2
        summed = t.narrow(dim, 0, 2 * half).unflatten(dim, (2, half)).sum(dim)
        t = torch.cat([summed, t.narrow(dim, 2 * half, 1)], dim) if size % 2 else summed
    return t.squeeze(dim)


class Int4Halves(Int4UnpackedTwo):
    """As `int4_unpacked_two`, the groups summed by adding halves instead of a reduction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group = x.shape[0], self.g, self.group
        values = self.b.to(torch.float32).view(self.n // BLOCK, g, group, BLOCK)
        partial = (x.view(r, 1, g, group, 1) * values).sum(3)
        sums = x.view(r, 1, g, group).sum(3, keepdim=True)
        scaled = (partial - self.z.to(torch.float32) * sums) * self.s
        return _sum_by_halves(scaled, 2).reshape(r, self.n)


class Int4Pairs(Int4UnpackedTwo):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group = x.shape[0], self.g, self.group
        values = self.b.to(torch.float32).view(self.n // BLOCK, g, group, BLOCK)
        partial = (x.view(r, 1, g, group, 1) * values).sum(3)
        sums = x.view(r, 1, g, group).sum(3, keepdim=True)
        scaled = (partial - self.z.to(torch.float32) * sums) * self.s
        return _sum_by_pairs(scaled, 2).reshape(r, self.n)


class Int4GroupTiles(Int4UnpackedTwo):
    """`int4_halves` over the weight laid out [N/16, G/t, group, t, 16]: t groups' 16 channels side by side at each
    position of the group, so the matvec's vector tile (t groups x 16 channels, the group's values in turn) reads
    one contiguous run of bytes; the partials come out [rows, N/16, G, 16] as before."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, tile: int) -> None:
        super().__init__(q, scale, zero, group)
        self.tile = tile
        nb, g = self.n // BLOCK, self.g
        self.b = self.b.view(nb, g // tile, tile, group, BLOCK).permute(0, 1, 3, 2, 4).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group, t = x.shape[0], self.g, self.group, self.tile
        xs = x.view(r, 1, g // t, t, group).transpose(3, 4).reshape(r, 1, g // t, group, t, 1)
        partial = (xs * self.b.to(torch.float32)).sum(3).reshape(r, self.n // BLOCK, g, BLOCK)
        sums = x.view(r, 1, g, group).sum(3, keepdim=True)
        scaled = (partial - self.z.to(torch.float32) * sums) * self.s
        return _sum_by_halves(scaled, 2).reshape(r, self.n)


class Int4GroupTilesFused(Int4GroupTiles):
    """(What the rule writes, with t = 4.) `int4_tiles4` with the scaling in the partials' own
    [rows, N/16, G/t, t, 16] shape (scales and zero points viewed alike), so IREE fuses it into the matvec; the
    groups summed by halves over G/t, then over t."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group, t = x.shape[0], self.g, self.group, self.tile
        nb = self.n // BLOCK
        xs = x.view(r, 1, g // t, t, group, 1).permute(0, 1, 2, 4, 3, 5)  # [r, 1, G/t, group, t, 1]
        partial = (xs * self.b.to(torch.float32)).sum(3)  # [r, N/16, G/t, t, 16]
        sums = x.view(r, 1, g // t, t, group).sum(4, keepdim=True)
        z = self.z.to(torch.float32).view(nb, g // t, t, BLOCK)
        scaled = (partial - z * sums) * self.s.view(nb, g // t, t, BLOCK)
        return _sum_by_halves(_sum_by_halves(scaled, 2), 2).reshape(r, self.n)


class Int4GroupTilesSymmetric(Int4GroupTiles):
    """`int4_tiles4_fused` for symmetric weights (zero points all zero: torchao's default `IntxWeightOnlyConfig`):
    the zero point's share and the sums of x dropped; scales read in `scale_dtype` (float32, or bfloat16 converted
    in the kernel)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, group: int, tile: int, scale_dtype: torch.dtype) -> None:
        super().__init__(q, scale, torch.zeros_like(scale, dtype=torch.int8), group, tile)
        del self.z
        self.s = self.s.to(scale_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group, t = x.shape[0], self.g, self.group, self.tile
        nb = self.n // BLOCK
        xs = x.view(r, 1, g // t, t, group, 1).permute(0, 1, 2, 4, 3, 5)  # [r, 1, G/t, group, t, 1]
        partial = (xs * self.b.to(torch.float32)).sum(3)  # [r, N/16, G/t, t, 16]
        scaled = partial * self.s.view(nb, g // t, t, BLOCK).to(torch.float32)
        return _sum_by_halves(_sum_by_halves(scaled, 2), 2).reshape(r, self.n)


class Int4GroupTilesPartials(Int4GroupTilesSymmetric):
    """`int4_tiles4_symmetric`'s first dispatch alone: the scaled partials [rows, N/16, G/t, t, 16] are the output
    (not summed: not the product; what the second stage costs is the difference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group, t = x.shape[0], self.g, self.group, self.tile
        xs = x.view(r, 1, g // t, t, group, 1).permute(0, 1, 2, 4, 3, 5)  # [r, 1, G/t, group, t, 1]
        partial = (xs * self.b.to(torch.float32)).sum(3)  # [r, N/16, G/t, t, 16]
        return partial * self.s.view(self.n // BLOCK, g // t, t, BLOCK).to(torch.float32)


class Int4GroupTilesScaledOne(Int4GroupTilesSymmetric):
    """Symmetric weights, the groups summed inside the matvec: one reduction over (G/t, group) of x * w * s, the
    scale constant along the group's values (no partials written back): [rows, N/16, t, 16], then t by halves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group, t = x.shape[0], self.g, self.group, self.tile
        nb = self.n // BLOCK
        xs = x.view(r, 1, g // t, t, group, 1).permute(0, 1, 2, 4, 3, 5)  # [r, 1, G/t, group, t, 1]
        s = self.s.view(nb, g // t, 1, t, BLOCK).to(torch.float32)
        partial = (xs * self.b.to(torch.float32) * s).sum([2, 3])  # [r, N/16, t, 16]
        return _sum_by_halves(partial, 2).reshape(r, self.n)


class Int4GroupTilesOne(Int4GroupTiles):
    """The layout of `int4_tiles4`, torchao's dequantize ((w - z) * s) inside one reduction over the groups and
    their values: [rows, N/16, t, 16] out, then summed over t by halves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group, t = x.shape[0], self.g, self.group, self.tile
        nb = self.n // BLOCK
        xs = x.view(r, 1, g // t, t, group, 1).permute(0, 1, 2, 4, 3, 5)  # [r, 1, G/t, group, t, 1]
        z = self.z.to(torch.float32).view(nb, g // t, 1, t, BLOCK)
        s = self.s.view(nb, g // t, 1, t, BLOCK)
        partial = (xs * ((self.b.to(torch.float32) - z) * s)).sum([2, 3])  # [r, N/16, t, 16]
        return _sum_by_halves(partial, 2).reshape(r, self.n)


class Int4NibblesI4(Int4GroupTilesSymmetric):
    """`int4_tiles4_symmetric` with its weight stored as IREE's `i4` (two values a byte: half the bytes): exported
    as the int8 form, then `i4_weight` rewrites the module text so that the weight is a `tensor<...xi4>` constant
    converted by `arith.sitofp` (the only nibble form IREE 3.13 keeps a contraction, docs/performance.md)."""

    i4_buffer = "b"


def _nibbles(form: type) -> object:
    return lambda w, q, q8, s8, s, z, g: form(_blocks(q), _blocks(s), g, 4, BLOCK)


class Int4PositionMajor(Int4UnpackedTwo):
    """`int4_halves` over the weight laid out [N/16, group, G, 16]: at each position of the group, every group's
    16 channels side by side (all of a block's groups read together, the group's values in turn)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> None:
        super().__init__(q, scale, zero, group)
        self.b = self.b.view(self.n // BLOCK, self.g, group, BLOCK).transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group = x.shape[0], self.g, self.group
        xs = x.view(r, 1, g, group).transpose(2, 3).reshape(r, 1, group, g, 1)
        partial = (xs * self.b.to(torch.float32)).sum(2)  # [r, N/16, G, 16]
        sums = x.view(r, 1, g, group).sum(3, keepdim=True)
        scaled = (partial - self.z.to(torch.float32) * sums) * self.s
        return _sum_by_halves(scaled, 2).reshape(r, self.n)


FORMS = {
    "f32": lambda w, q, q8, s8, s, z, g: F32(w),
    "int8_blocked": lambda w, q, q8, s8, s, z, g: Int8Blocked(q8, s8),
    "int4_unpacked_two": lambda w, q, q8, s8, s, z, g: Int4UnpackedTwo(q, s, z, g),
    "int4_packed_two": lambda w, q, q8, s8, s, z, g: Int4PackedTwo(q, s, z, g),
    "int4_packed_shifts": lambda w, q, q8, s8, s, z, g: Int4PackedShifts(q, s, z, g),
    "int4_packed_shifts_one": lambda w, q, q8, s8, s, z, g: Int4PackedShiftsOne(q, s, z, g),
    "int4_gmajor": lambda w, q, q8, s8, s, z, g: Int4GroupMajor(q, s, z, g),
    "int4_groups_last": lambda w, q, q8, s8, s, z, g: Int4GroupsLast(q, s, z, g),
    "int4_halves": lambda w, q, q8, s8, s, z, g: Int4Halves(q, s, z, g),
    "int4_pairs": lambda w, q, q8, s8, s, z, g: Int4Pairs(q, s, z, g),
    "int4_packed_one": lambda w, q, q8, s8, s, z, g: Int4PackedOne(q, s, z, g),
    "int4_packed_prescaled": lambda w, q, q8, s8, s, z, g: Int4PackedPrescaled(q, s, z, g),
    "int4_tiles2": lambda w, q, q8, s8, s, z, g: Int4GroupTiles(q, s, z, g, 2),
    "int4_tiles4": lambda w, q, q8, s8, s, z, g: Int4GroupTiles(q, s, z, g, 4),
    "int4_tiles8": lambda w, q, q8, s8, s, z, g: Int4GroupTiles(q, s, z, g, 8),
    "int4_tiles4_fused": lambda w, q, q8, s8, s, z, g: Int4GroupTilesFused(q, s, z, g, 4),
    "int4_tiles2_fused": lambda w, q, q8, s8, s, z, g: Int4GroupTilesFused(q, s, z, g, 2),
    "int4_tiles4_one": lambda w, q, q8, s8, s, z, g: Int4GroupTilesOne(q, s, z, g, 4),
    "int4_tiles4_symmetric": lambda w, q, q8, s8, s, z, g: Int4GroupTilesSymmetric(q, s, g, 4, torch.float32),
    "int4_tiles4_symmetric_bf16": lambda w, q, q8, s8, s, z, g: Int4GroupTilesSymmetric(q, s, g, 4, torch.bfloat16),
    "int4_tiles4_partials": lambda w, q, q8, s8, s, z, g: Int4GroupTilesPartials(q, s, g, 4, torch.float32),
    "int4_tiles4_scaled_one": lambda w, q, q8, s8, s, z, g: Int4GroupTilesScaledOne(q, s, g, 4, torch.float32),
    "int4_position_major": lambda w, q, q8, s8, s, z, g: Int4PositionMajor(q, s, z, g),
    "int4_tiles4_i4": lambda w, q, q8, s8, s, z, g: Int4NibblesI4(q, s, g, 4, torch.float32),
    **{name: _nibbles(form) for name, form in NIBBLE_FORMS.items()},
}


def weights(n: int, k: int, group: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    s8 = w.abs().amax(1) / 127
    q8 = torch.round(w / s8[:, None]).clamp(-128, 127).to(torch.int8)
    wg = w.view(n, k // group, group)
    s = wg.abs().amax(2) / 7.5
    z = torch.randint(-2, 3, (n, k // group), dtype=torch.int8)
    q = (torch.round(wg / s[..., None]) + z[..., None]).clamp(-8, 7).to(torch.int8).view(n, k)
    return w, q, q8, s8, s, z


def reference(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group: int, x: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    deq = ((q.view(n, -1, group).double() - z[..., None].double()) * s[..., None].double()).view(n, k)
    return x.double() @ deq.t()


def _iree_against_torch(vmfb: Path, module: torch.nn.Module, rows: int, k: int) -> float:
    """Max abs difference of the compiled module's output from the torch module's for x filled with 0.5 (the
    benchmark's input): the form compiled computes what it says."""
    import numpy as np

    out = vmfb.with_suffix(".npy")
    subprocess.run(
        ["iree-run-module", f"--module={vmfb}", "--device=local-sync", "--function=main",
         f"--input={rows}x{k}xf32=0.5", f"--output=@{out}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    with torch.no_grad():
        want = module(torch.full((rows, k), 0.5))
    return (torch.from_numpy(np.load(out)) - want).abs().max().item()


def run(argv: list[str] | None = None) -> int:
    global BLOCK
    from cpu_isa import backend, cpu_model

    from fx_rewrites.backends.iree.importing import import_mlir, iree_modules
    from fx_rewrites.backends.iree.preparing import prepare_program

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2816)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--repetitions", type=int, default=10, help="at least 2 (the median is of repetitions)")
    parser.add_argument("--keep", default="", help="a folder to keep each form's .mlir and .vmfb in")
    parser.add_argument("--isa", default="host", choices=("host", "avx2", "avx512"), help="avx2: IREE for znver3")
    parser.add_argument("--flags", default="", help="extra iree-compile flags, comma separated")
    parser.add_argument("--block", type=int, default=16, help="output channels side by side (16; 8: AVX2's lanes)")
    args = parser.parse_args(argv)
    BLOCK = args.block  # read by every form's layout
    if args.repetitions < 2:
        parser.error("--repetitions must be at least 2: iree-benchmark-module prints a median of repetitions only")
    w, q, q8, s8, s, z = weights(args.n, args.k, args.group)
    x = torch.randn(args.rows, args.k)
    ref = reference(q, s, z, args.group, x)
    ref0 = reference(q, s, torch.zeros_like(z), args.group, x)  # the symmetric forms read q as if z were 0
    iree = backend(args.isa)
    target = " ".join(iree.flags[:1])
    print(f"CPU: {cpu_model()}; IREE target {target}; {args.n} x {args.k}, rows {args.rows}, block {BLOCK}")
    flags = [*iree.flags, *iree.perf_flags, FUSION, *filter(None, args.flags.split(","))]
    print(
        "| form | ms (CPU, median) | weight bytes | max abs diff (int4 vs float64) | IREE vs torch (x = 0.5) |\n"
        "|---|---:|---:|---:|---:|"
    )
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for name in args.forms.split(","):
            module = FORMS[name](w, q, q8, s8, s, z, args.group).eval()
            got = module(x)
            want = ref0 if any(tag in name for tag in ("symmetric", "scaled_one", "_i4", "nibbles", "i8_")) else ref
            product = name.startswith("int4") and not name.endswith("_partials")
            diff = (got.double() - want).abs().max().item() if product else float("nan")
            nbytes = sum(b.numel() * b.element_size() for b in module.buffers())
            program = torch.export.export(module, (x,))
            mlir = str(import_mlir(iree_modules(), prepare_program(program)[0]))
            if getattr(module, "i4_buffer", None):
                weight = getattr(module, module.i4_buffer)
                mlir = i4_weight(mlir, weight)
                nbytes -= weight.numel() // 2  # two values a byte
            if name in NIBBLE_FORMS:
                mlir = mutable_weight(mlir, module.p)
            src, vmfb = Path(tmp, f"{name}.mlir"), Path(tmp, f"{name}.vmfb")
            src.write_text(mlir)
            cmd = ["iree-compile", "--iree-input-type=torch", "--iree-hal-target-backends=llvm-cpu", *flags]
            done = subprocess.run([*cmd, str(src), "-o", str(vmfb)], capture_output=True, text=True)
            if done.returncode:
                print(f"| {name} | compile failed: {done.stderr[-300:]!r} | | |")
                continue
            bench = subprocess.run(
                ["iree-benchmark-module", f"--module={vmfb}", "--device=local-sync", "--function=main",
                 f"--input={args.rows}x{args.k}xf32=0.5", f"--benchmark_repetitions={args.repetitions}"],
                capture_output=True, text=True,
            )  # fmt: skip
            found = MEDIAN.findall(bench.stdout)
            ms = float(found[0][1]) * UNITS[found[0][2]] if found else float("nan")
            if not found:
                print(bench.stdout[-500:], bench.stderr[-500:], file=sys.stderr)
            iree_diff = _iree_against_torch(vmfb, module, args.rows, args.k)
            print(f"| {name} | {ms:.3f} | {nbytes / 1e6:.2f} MB | {diff:.2e} | {iree_diff:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
