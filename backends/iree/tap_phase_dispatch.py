"""The tap convolution's input, padded and split into its phases, in one hand-written dispatch (issue 32; llvm-cpu).

    o[n, c, a s + b, h, w] = x[n, c, s h + a - top, s w + b - left], zero outside x   # o [N, C, s s, Hq, Wq]

what `tap_conv_dispatch.phases` of the padded image gives. IREE 3.13 wrote it as three passes: a fill of the padded
image with zeros, a copy of x into it and a transposition into the phases (AVX2, 3x3/2 128->128 over 56x56: 0.33
ms of the call's ~5, against the convolution's 3.6; docs/performance.md "The strided kxk convolution's phases in
one pass"). Here one workgroup takes `PLANES` (n, c) planes; a plane's output (13 KB at 56x56) is zeroed in L1,
then each input row is read once, a chunk of s vectors at a time, and each column phase b (every s-th column, a
`vector.shuffle`) stored at its phase row; chunks past the row's end are masked.

It enters a graph as `fx_rewrites::tap_phases(x, stride, top, left, hq, wq, lanes)` (eager: the padding and
`phases`); the rules writing it are in `rules/tap_conv_dispatch.py`, before `tap_conv2d`.
"""

from __future__ import annotations

import re

import torch

from fx_rewrites.backends.iree import spliced

OP, MARK = "fx_rewrites::tap_phases", "torch.fx_rewrites.tap_phases"
MARKS = (MARK,)
#: input planes (n, c) a workgroup
PLANES = 4


def _padding(height: int, width: int, stride: int, top: int, left: int, hq: int, wq: int) -> list[int]:
    """`constant_pad_nd`'s padding of an image [height, width] to [stride hq, stride wq], `top` and `left` first."""
    return [left, stride * wq - width - left, top, stride * hq - height - top]


@torch.library.custom_op(OP, mutates_args=())
def tap_phases(x: torch.Tensor, stride: int, top: int, left: int, hq: int, wq: int, lanes: int) -> torch.Tensor:
    """`x` [N, C, H, W] padded by `top` rows and `left` columns of zeros (and zeros after, to [s hq, s wq]), as its
    s s phases [N, C, s s, hq, wq] (`tap_conv_dispatch.phases`; `lanes`: the dispatch's vectors)."""
    from fx_rewrites.backends.iree.tap_conv_dispatch import phases

    padded = torch.nn.functional.pad(x, _padding(*x.shape[2:], stride, top, left, hq, wq))
    return phases(padded, stride).contiguous()


@tap_phases.register_fake
def _(x: torch.Tensor, stride: int, top: int, left: int, hq: int, wq: int, lanes: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1], stride * stride, hq, wq)


TAP_PHASES = torch.ops.fx_rewrites.tap_phases.default


def _kernel(planes: int, h: int, w: int, s: int, top: int, left: int, hq: int, wq: int, lanes: int) -> str:
    """The function body over `PLANES` planes a workgroup (the last: the rest)."""
    size, vec, mask = s * s * hq * wq, f"vector<{lanes}xf32>", f"vector<{lanes}xi1>"
    xt, ot = f"memref<{planes * h * w}xf32>", f"memref<{planes * size}xf32>"
    add = (lines := []).append
    for line in (
        "%c0 = arith.constant 0 : index",
        f"%zero = arith.constant dense<0.0> : {vec}",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}",
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}",
        "%g = stream.dispatch.workgroup.id[0] : index",
        f"%p0 = arith.muli %g, %c{PLANES}w : index",
        f"%p1a = arith.addi %p0, %c{PLANES}w : index",
        f"%p1 = arith.minui %p1a, %c{planes}w : index",
        "scf.for %p = %p0 to %p1 step %c1w {",
        f"%xb = arith.muli %p, %c{h * w}w : index",
        f"%ob = arith.muli %p, %c{size}w : index",
    ):
        add(line)
    # the plane's output zeroed (it stays in L1 for the rows' stores)
    whole = size - size % lanes
    add(f"scf.for %z = %c0 to %c{whole}w step %c{lanes}w {{")
    add("%za = arith.addi %ob, %z : index")
    add(f"vector.store %zero, %om[%za] : {ot}, {vec}")
    add("}")
    if size % lanes:
        add(f"%zm = vector.constant_mask [{size % lanes}] : {mask}")
        add(f"%zt = arith.addi %ob, %c{whole}w : index")
        add(f"vector.maskedstore %om[%zt], %zm, %zero : {ot}, {mask}, {vec}")
    # each input row r: padded row r + top, phase row a = (r + top) % s, h = (r + top) / s
    add(f"scf.for %r = %c0 to %c{h}w step %c1w {{")
    add(f"%rx = arith.muli %r, %c{w}w : index")
    add("%xr = arith.addi %xb, %rx : index")
    add(f"%pr = arith.addi %r, %c{top}w : index")
    add(f"%ra = arith.remui %pr, %c{s}w : index")
    add(f"%rh = arith.divui %pr, %c{s}w : index")
    add(f"%rs = arith.muli %ra, %c{s * hq * wq}w : index")  # phase a s + b starts (a s + b) hq wq floats in
    add(f"%rw = arith.muli %rh, %c{wq}w : index")
    add("%rb = arith.addi %rs, %rw : index")
    add("%or = arith.addi %ob, %rb : index")
    masks: set[int] = set()

    def masked(used: int) -> str:
        if used not in masks:
            masks.add(used)
            add(f"%m{used} = vector.constant_mask [{used}] : {mask}")
        return f"%m{used}"

    for i in range(-(-w // (s * lanes))):  # chunk i: input columns [i s lanes, (i + 1) s lanes)
        loaded = []
        for u in range(s):
            start = (i * s + u) * lanes
            used, name = min(lanes, w - start), f"%x{i}_{u}"
            if used <= 0:
                loaded.append("%zero")
                continue
            add(f"%xi{i}_{u} = arith.addi %xr, %c{start}w : index")
            if used == lanes:
                add(f"{name} = vector.load %xm[%xi{i}_{u}] : {xt}, {vec}")
            else:
                types = f"{xt}, {mask}, {vec} into {vec}"
                add(f"{name} = vector.maskedload %xm[%xi{i}_{u}], {masked(used)}, %zero : {types}")
            loaded.append(name)
        for t in range(s):  # columns j = s k + t: phase b = (t + left) % s, at w = k + (t + left) // s
            count = min(lanes, -(-(w - t) // s) - i * lanes)
            if count <= 0:
                continue
            value = loaded[0]
            if s > 1:
                value = f"%v{i}_{t}"
                picks = ", ".join(str(t + s * k) for k in range(lanes))
                add(f"{value} = vector.shuffle {loaded[0]}, {loaded[1]} [{picks}] : {vec}, {vec}")
            b, shift = (t + left) % s, (t + left) // s
            at = f"%oi{i}_{t}"
            add(f"{at} = arith.addi %or, %c{b * hq * wq + shift + i * lanes}w : index")
            if count == lanes:
                add(f"vector.store {value}, %om[{at}] : {ot}, {vec}")
            else:
                add(f"vector.maskedstore %om[{at}], {masked(count)}, {value} : {ot}, {mask}, {vec}")
    add("}")
    add("}")
    add("return")
    return spliced.with_index_constants("\n".join(lines))


def executable(n: int, c: int, h: int, w: int, s: int, top: int, left: int, hq: int, wq: int, lanes: int):
    """The name (unique per shape: findings 52) and text of the `stream.executable` over ceil(N C / PLANES)
    workgroups."""
    if s not in (1, 2) or lanes not in (8, 16):
        raise ValueError(f"tap_phases of stride {s} in vectors of {lanes}: strides 1 and 2, 8 or 16 lanes")
    name = f"tapphases_{n}x{c}x{h}x{w}_s{s}_t{top}_l{left}_{hq}x{wq}_v{lanes}"
    body = _kernel(n * c, h, w, s, top, left, hq, wq, lanes)
    return name, spliced.executable(name, "%bx: !stream.binding, %bo: !stream.binding", 1, body)


_CALL = re.compile(
    rf'^(\s*)(%[\w]+) = torch\.operator "{re.escape(MARK)}"\((%[\w#]+)((?:, %[\w]+){{6}})\) : \((.*)\) -> (.*)$'
)


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.tap_phases` call replaced by a `flow.dispatch` of its executable. ValueError
    where a call has another form (dynamic sizes: the rule takes static ones only)."""
    return spliced.splice_each(mlir, MARK, "tap_phases", _convert)


def _convert(line: str, ints: dict[str, str]) -> spliced.Spliced:
    found = _CALL.match(line)
    scalars = found.group(4).split(", ")[1:] if found else []
    if not found or any(name not in ints for name in scalars):
        raise ValueError(f"a tap_phases call of an unknown form: {line.strip()[:200]}")
    pad, res, x, _, types, otype = found.groups()
    vx = re.findall(r"!torch\.vtensor<[^>]*>", types)[0]
    sizes = spliced._tensor(vx)[1]
    if "?" in sizes:
        raise ValueError(f"a tap_phases call with a dynamic size: {line.strip()[:200]}")
    n, c, h, w = (int(v) for v in sizes)
    s, top, left, hq, wq, lanes = (int(ints[name]) for name in scalars)
    name, text = executable(n, c, h, w, s, top, left, hq, wq, lanes)
    to = f"tensor<{n}x{c}x{s * s}x{hq}x{wq}xf32>"
    count = -(-n * c // PLANES)
    return spliced.dispatch_lines(pad, f"tph{res[1:]}", name, [(x, vx)], count, to, res, otype), name, text
