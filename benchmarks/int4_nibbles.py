"""Nibble and integer-product forms of the symmetric int4 g32 matvec for `benchmarks/int4_forms.py` (issue 33).

Nibbles: llama.cpp's Q4_0 idea inside `int4_tiles4_symmetric`'s layout. Its [N/16, G/4, 32, 4, 16] values are packed
along the group's positions: the byte at position j (0..15) holds value j in its low nibble and value j + 16 in its
high one ([N/16, G/4, 16, 4, 16] int8, half the bytes). Each byte is sign-extended to int32 once; the low value is
shifted to the top four bits (`<< 28`), the high one masked there (`<< 24`, `& 0xF0000000`): both are q * 2^28
exactly, converted to float32 and scaled by s * 2^-28 (a power of two: the products and sums are the byte form's).

- `int4_nibbles_shifts`: both values from one shift and mask over a broadcast of the bytes (shifts [28, 24] along a
  new axis of 2), reshaped to the group's 32 positions and reduced (IREE materializes the unpacked float32 weight).
- `int4_nibbles_axes`: the same reduced over the (2, 16) axes as they come (one dispatch, a reduction-vectorized one).
- `int4_nibbles_halves`: partials per nibble (the axis of 2 parallel), added after; `int4_nibbles_outer`: the same,
  the axis of 2 outermost.
- `int4_nibbles_channels`: the byte pairs channels c and c + 8 of the block instead of positions.
- `int4_nibbles_cat`: the two values computed apart and concatenated along the positions.
- `int4_nibbles_two`: two reductions (low values against x's first 16 of each group, high against its last 16),
  their partials added; `int4_nibbles_two_splat`: the same with scalar shifts (`w << 28`; `w & -16` against 2^24 x).

Integer products (llama.cpp's Q4_0 x Q8_0): `int4_i8_products` quantizes x per row to int8 and sums each group's
int8 x int8 products in int32 over the byte form's layout; `int4_i8_batched` writes it as a batched matmul over the
groups. Their values are not the float forms' (x rounded to 8 bits).

The byte form's tile: `int4_symmetric_two` (its reduction split in two halves of the bytes) and
`int4_symmetric_shifted` (an integer op in the body: `w << 24` against s * 2^-24) ask whether the eight-accumulator
tile IREE gives the two-reduction nibble forms would come to the bytes; it does not (findings 45).

These forms are compiled with their bytes in a mutable `util.global` (`mutable_weight`); on the decode shapes the
.vmfb holds the packed bytes (1.82 MB against the byte form's 3.26 on 2816 x 1024; 20.5 against 36.9 on 32000).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

#: the top nibble of an int32 (0xF0000000 as a signed value)
TOP = -(1 << 28)
#: the weight's values are q * 2^28 once unpacked
UNIT = 2.0**-28


def pack_nibbles(values: torch.Tensor, dim: int) -> torch.Tensor:
    """int4 values (int8 in [-8, 7]) packed two a byte along `dim` (of even size 2h): byte j holds value j in its
    low nibble, value j + h in its high one (int8)."""
    h = values.shape[dim] // 2
    low, high = values.narrow(dim, 0, h).to(torch.int16), values.narrow(dim, h, h).to(torch.int16)
    return ((low & 15) | (high << 4)).to(torch.int8).contiguous()


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """`pack_nibbles`'s values times 2^28 as float32 (exact), both halves from one shift and one mask over the
    bytes widened to int32 and broadcast along a new axis of 2 before `dim`: [..., 2, h, ...]."""
    shape = [1] * (packed.dim() + 1)
    shape[dim] = 2
    shifts = (28 - 4 * torch.arange(2, dtype=torch.int32)).view(shape)  # an op, not a lifted constant
    wide = packed.to(torch.int32).unsqueeze(dim)
    return torch.bitwise_and(torch.bitwise_left_shift(wide, shifts), TOP).to(torch.float32)


class Int4Nibbles(torch.nn.Module):
    """`int4_tiles4_symmetric` over nibbles: the weight [N/16, G/t, group/2, t, 16] int8, scales s * 2^-28."""

    def __init__(self, blocked: torch.Tensor, scale: torch.Tensor, group: int, tile: int, block: int) -> None:
        super().__init__()
        nb, k, _ = blocked.shape  # [N/16, K, 16] int8 values
        self.n, self.k, self.g, self.group, self.tile, self.block = nb * block, k, k // group, group, tile, block
        values = blocked.view(nb, self.g // tile, tile, group, block).permute(0, 1, 3, 2, 4)
        self.register_buffer("p", pack_nibbles(values, 2))  # [N/16, G/t, group/2, t, 16]
        self.register_buffer("s", (scale * UNIT).contiguous())  # [N/16, G, 16], exact

    def _xs(self, x: torch.Tensor) -> torch.Tensor:
        r, g, group, t = x.shape[0], self.g, self.group, self.tile
        return x.view(r, 1, g // t, t, group, 1).permute(0, 1, 2, 4, 3, 5)  # [r, 1, G/t, group, t, 1]

    def _values(self) -> torch.Tensor:
        nb, g, t = self.n // self.block, self.g, self.tile
        return unpack_nibbles(self.p, 2).view(nb, g // t, self.group, t, self.block)

    def _finish(self, partial: torch.Tensor) -> torch.Tensor:
        from int4_forms import _sum_by_halves

        nb, g, t = self.n // self.block, self.g, self.tile
        scaled = partial * self.s.view(nb, g // t, t, self.block)
        return _sum_by_halves(_sum_by_halves(scaled, 2), 2).reshape(partial.shape[0], self.n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish((self._xs(x) * self._values()).sum(3))


class Int4NibblesAxes(Int4Nibbles):
    """The reduction over the (2, group/2) axes as they come out of the unpacking (no reshape between)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, h, t = x.shape[0], self.g, self.group // 2, self.tile
        xs = x.view(r, 1, g // t, t, 2, h, 1).permute(0, 1, 2, 4, 5, 3, 6)  # [r, 1, G/t, 2, group/2, t, 1]
        return self._finish((xs * unpack_nibbles(self.p, 2)).sum([3, 4]))


class Int4NibblesHalves(Int4Nibbles):
    """Partials per nibble (the axis of 2 parallel: [rows, N/16, G/t, 2, t, 16], one reduction over group/2), the
    two added after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, h, t = x.shape[0], self.g, self.group // 2, self.tile
        xs = x.view(r, 1, g // t, t, 2, h, 1).permute(0, 1, 2, 4, 5, 3, 6)  # [r, 1, G/t, 2, group/2, t, 1]
        partial = (xs * unpack_nibbles(self.p, 2)).sum(4)  # [r, N/16, G/t, 2, t, 16]
        return self._finish(partial[:, :, :, 0] + partial[:, :, :, 1])


class Int4NibblesOuter(Int4Nibbles):
    """`int4_nibbles_halves` with the axis of 2 outermost: partials [rows, 2, N/16, G/t, t, 16]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, h, t = x.shape[0], self.g, self.group // 2, self.tile
        xs = x.view(r, 1, g // t, t, 2, h, 1).permute(0, 4, 1, 2, 5, 3, 6)  # [r, 2, 1, G/t, group/2, t, 1]
        partial = (xs * unpack_nibbles(self.p, 0)).sum(4)  # [r, 2, N/16, G/t, t, 16]
        return self._finish(partial[:, 0] + partial[:, 1])


class Int4NibblesChannels(Int4Nibbles):
    """The byte pairs channels instead of positions: channel c of the 16-block in the low nibble, c + 8 in the
    high one ([N/16, G/t, group, t, 8] bytes); the unpacked axis of 2 is the channels' outer half."""

    def __init__(self, blocked: torch.Tensor, scale: torch.Tensor, group: int, tile: int, block: int) -> None:
        super().__init__(blocked, scale, group, tile, block)
        nb = blocked.shape[0]
        values = blocked.view(nb, self.g // tile, tile, group, block).permute(0, 1, 3, 2, 4)
        self.p = pack_nibbles(values, 4)  # [N/16, G/t, group, t, 8]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, g, t, nb = x.shape[0], self.g, self.tile, self.n // self.block
        xs = self._xs(x).unsqueeze(-1)  # [r, 1, G/t, group, t, 1, 1]
        partial = (xs * unpack_nibbles(self.p, 4)).sum(3)  # [r, N/16, G/t, t, 2, 8]
        scaled = partial * self.s.view(nb, g // t, t, 2, self.block // 2)
        from int4_forms import _sum_by_halves

        return _sum_by_halves(_sum_by_halves(scaled, 2), 2).reshape(r, self.n)


class Int4NibblesCat(Int4Nibbles):
    def _values(self) -> torch.Tensor:
        wide = self.p.to(torch.int32)
        low = torch.bitwise_left_shift(wide, torch.full((), 28, dtype=torch.int32))
        high = torch.bitwise_and(torch.bitwise_left_shift(wide, torch.full((), 24, dtype=torch.int32)), TOP)
        return torch.cat([low, high], 2).to(torch.float32)


class Int4NibblesTwo(Int4Nibbles):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = unpack_nibbles(self.p, 2)  # [N/16, G/t, 2, group/2, t, 16]
        xs = self._xs(x)
        h = self.group // 2
        low = (xs[:, :, :, :h] * values[:, :, 0]).sum(3)
        high = (xs[:, :, :, h:] * values[:, :, 1]).sum(3)
        return self._finish(low + high)


class Int4NibblesTwoSplat(Int4Nibbles):
    """`int4_nibbles_two` with its shifts scalars (splat constants inlined into the kernel): the low value
    `w << 28`, the high one `w & -16` (16 q) against x times 2^24."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.p.to(torch.int32)
        low = torch.bitwise_left_shift(wide, torch.full((), 28, dtype=torch.int32)).to(torch.float32)
        high = torch.bitwise_and(wide, -16).to(torch.float32)
        xs = self._xs(x)
        h = self.group // 2
        low_sum = (xs[:, :, :, :h] * low).sum(3)
        high_sum = ((xs[:, :, :, h:] * 2.0**24) * high).sum(3)
        return self._finish(low_sum + high_sum)


NIBBLE_FORMS = {
    "int4_nibbles_shifts": Int4Nibbles,
    "int4_nibbles_cat": Int4NibblesCat,
    "int4_nibbles_two": Int4NibblesTwo,
    "int4_nibbles_axes": Int4NibblesAxes,
    "int4_nibbles_halves": Int4NibblesHalves,
    "int4_nibbles_channels": Int4NibblesChannels,
    "int4_nibbles_outer": Int4NibblesOuter,
    "int4_nibbles_two_splat": Int4NibblesTwoSplat,
}


def mutable_weight(mlir: str, weight: torch.Tensor) -> str:
    """`mlir` with the int8 literals of `weight`'s shape (export repeats it for a metadata assert) read from a
    mutable `util.global` of the same bytes. IREE makes a global that is never stored immutable, so this keeps the
    bytes only where folding the unpacking would grow the module past `--iree-opt-const-expr-max-size-increase-
    threshold` (a 512 x 1024 weight and up: the decode shapes); on a 64 x 128 weight the unpacking is hoisted and
    folded into float32 constants at compile time."""
    shape = "x".join(map(str, weight.shape))
    dims = ",".join(map(str, weight.shape))
    literal = re.compile(
        rf"^(\s*)(%[\w]+) = torch\.vtensor\.literal\(dense_resource<[\w.]+> : tensor<{shape}xsi8>\) : .*$"
    )
    data = weight.contiguous().view(torch.uint8).numpy().tobytes().hex().upper()
    tensor = f"tensor<{shape}xi8>"

    def load(line: str) -> list[str] | None:
        found = literal.match(line)
        if not found:
            return None
        pad, out = found.group(1), found.group(2)
        tmp = f"%mw_{out[1:]}"
        return [
            f"{pad}{tmp} = util.global.load @packed_weight : {tensor}",
            f"{pad}{out} = torch_c.from_builtin_tensor {tmp} : {tensor} -> !torch.vtensor<[{dims}],si8>",
        ]

    return _read_from_mutable_global(mlir, "packed_weight", tensor, data, load, f"no int8 literal of shape {shape}")


def _read_from_mutable_global(
    mlir: str, name: str, tensor: str, data: str, replace: Callable[[str], list[str] | None], missing: str
) -> str:
    """`mlir` with every line `replace` gives lines for swapped for them, and `util.global private mutable @name`
    (`tensor`, bytes `data` in hex) declared at the module's start; ValueError naming `missing` where none was."""
    lines, done = [], 0
    for line in mlir.splitlines():
        new = replace(line)
        if new is not None:
            lines += new
            done += 1
            continue
        if line.startswith("module {") and not done:
            lines += [line, f'  util.global private mutable @{name} = dense<"0x{data}"> : {tensor}']
            continue
        lines.append(line)
    if not done:
        raise ValueError(f"{missing} in the module")
    return "\n".join(lines)


class Int4Int8Products(Int4Nibbles):
    """Not nibbles: `int4_tiles4_symmetric`'s bytes times x quantized per row to int8 (scale max|x| / 127), the
    group's products summed in int32 (llama.cpp's Q4_0 x Q8_0), then converted and scaled by the weight's and the
    row's scales. Other values than the float forms (x rounded to 8 bits)."""

    def __init__(self, blocked: torch.Tensor, scale: torch.Tensor, group: int, tile: int, block: int) -> None:
        super().__init__(blocked, scale, group, tile, block)
        nb = blocked.shape[0]
        self.p = blocked.view(nb, self.g // tile, tile, group, block).permute(0, 1, 3, 2, 4).contiguous()
        self.s = scale.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from int4_forms import _sum_by_halves

        r, g, t, nb = x.shape[0], self.g, self.tile, self.n // self.block
        sx = x.abs().amax(1, keepdim=True) / 127
        xq = torch.round(x / sx).clamp(-127, 127).to(torch.int8)
        xs = self._xs(xq).to(torch.int32)
        partial = (xs * self.p.to(torch.int32)).sum(3, dtype=torch.int32)  # [r, N/16, G/t, t, 16] int32
        scaled = partial.to(torch.float32) * self.s.view(nb, g // t, t, self.block) * sx.view(r, 1, 1, 1, 1)
        return _sum_by_halves(_sum_by_halves(scaled, 2), 2).reshape(r, self.n)


NIBBLE_FORMS["int4_i8_products"] = Int4Int8Products


class Int4Int8Batched(Int4Int8Products):
    """`int4_i8_products` as a batched matmul over the groups (x's [G, rows, group] int8 times the weight's
    [G, group, N] int8, int32 out: a form IREE may data-tile for its s8s8s32 kernel), scaled, summed over G."""

    def __init__(self, blocked: torch.Tensor, scale: torch.Tensor, group: int, tile: int, block: int) -> None:
        super().__init__(blocked, scale, group, tile, block)
        nb = blocked.shape[0]
        q = blocked.permute(0, 2, 1).reshape(nb * block, self.k)  # [N, K]
        self.p = q.view(self.n, self.g, group).permute(1, 2, 0).contiguous()  # [G, group, N]
        self.s = scale.permute(1, 0, 2).reshape(self.g, 1, self.n).contiguous()  # [G, 1, N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = x.shape[0]
        sx = x.abs().amax(1, keepdim=True) / 127
        xq = torch.round(x / sx).clamp(-127, 127).to(torch.int8)
        xg = xq.view(r, self.g, self.group).transpose(0, 1).to(torch.int32)  # [G, rows, group]
        partial = torch.bmm(xg, self.p.to(torch.int32))  # [G, rows, N] int32
        return (partial.to(torch.float32) * self.s).sum(0) * sx


NIBBLE_FORMS["int4_i8_batched"] = Int4Int8Batched


def i4_weight(mlir: str, weight: torch.Tensor) -> str:
    """`mlir` with the float32 conversion of the int8 literal of `weight`'s shape replaced by the same values read
    from an `i4` global (one hex byte a value in the text; IREE stores two a byte) converted by `arith.sitofp`.
    The global is mutable: a constant (or an immutable global, inlined) would be folded with its conversion into
    a float32 constant at compile time."""
    shape = "x".join(map(str, weight.shape))
    dims = ",".join(map(str, weight.shape))
    literal = re.compile(rf"(%[\w]+) = torch\.vtensor\.literal\(dense_resource<[\w.]+> : tensor<{shape}xsi8>\)")
    names = set(literal.findall(mlir))
    convert = re.compile(r"^(\s*)(%[\w]+) = torch\.aten\.to\.dtype (%[\w]+), .*-> !torch\.vtensor<\[(.*)\],f32>(.*)$")
    nibbles = (weight.flatten().to(torch.int16) & 15).to(torch.uint8).numpy().tobytes().hex().upper()
    tensor = f"tensor<{shape}xi4>"

    def load(line: str) -> list[str] | None:
        found = convert.match(line)
        if not (found and found.group(3) in names):
            return None
        pad, out = found.group(1), found.group(2)
        tmp, vtensor = f"%i4_{out[1:]}", f"!torch.vtensor<[{dims}],f32>"
        return [
            f"{pad}{tmp} = util.global.load @i4_weight : {tensor}",
            f"{pad}{tmp}f = arith.sitofp {tmp} : {tensor} to tensor<{shape}xf32>",
            f"{pad}{out} = torch_c.from_builtin_tensor {tmp}f : tensor<{shape}xf32> -> {vtensor}",
        ]

    missing = f"no float32 conversion of an int8 literal of shape {shape}"
    return _read_from_mutable_global(mlir, "i4_weight", tensor, nibbles, load, missing)


class Int4BytesTwo(Int4Nibbles):
    """Not nibbles: `int4_tiles4_symmetric`'s bytes with the group's reduction split in two (positions 0-15 and
    16-31, each against its own half of the bytes), the partials added: the reduction of 16 that the two-reduction
    nibble forms get eight accumulators for."""

    def __init__(self, blocked: torch.Tensor, scale: torch.Tensor, group: int, tile: int, block: int) -> None:
        super().__init__(blocked, scale, group, tile, block)
        nb = blocked.shape[0]
        self.p = blocked.view(nb, self.g // tile, tile, group, block).permute(0, 1, 3, 2, 4).contiguous()
        self.s = scale.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs, h = self._xs(x), self.group // 2
        low = (xs[:, :, :, :h] * self.p[:, :, :h].to(torch.float32)).sum(3)
        high = (xs[:, :, :, h:] * self.p[:, :, h:].to(torch.float32)).sum(3)
        return self._finish(low + high)


NIBBLE_FORMS["int4_symmetric_two"] = Int4BytesTwo


class Int4BytesShifted(Int4BytesTwo):
    """Not nibbles: `int4_tiles4_symmetric`'s bytes read as (w << 24) against s * 2^-24 (exact): an integer op in
    the matvec's body, as the nibble forms have."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.bitwise_left_shift(self.p.to(torch.int32), torch.full((), 24, dtype=torch.int32))
        partial = (self._xs(x) * wide.to(torch.float32)).sum(3)
        return self._finish(partial * 2.0**-24)


NIBBLE_FORMS["int4_symmetric_shifted"] = Int4BytesShifted
