"""Hand-written dispatches spliced into torch-mlir's import (issue 33; docs/iree-3.13-findings.md sections 49, 52, 53).

A kernel module (`int4_dispatch`, `a8int4_dispatch`) defines a `torch.library` op that a rule writes into the graph
and torch-mlir imports as `torch.operator "torch.fx_rewrites.NAME"(tensors..., n, tile, per)`, and the text of a
`stream.executable` per shape. `splice_calls` replaces each such line by a `flow.dispatch` of that executable
between `torch_c` conversions (the executables declared once at the module's start; a dynamic row count passed as
an operand); the convolution kernels, whose calls take other operands, convert each line themselves and share the
rest (`splice_each`, `dispatch_lines`). `kernels.py` lists the kernel modules: `IreeBackend` splices them all
(`kernels.spliced`), the compile cache keys a module by its spliced text (a kernel's code and constants are in it),
and `legality.SPLICED` names their ops.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_TYPE = re.compile(r"!torch\.vtensor<\[([\d?,]*)\],(\w+)>")
_DTYPES = {"si8": "i8", "si32": "i32", "f32": "f32"}
_INT = re.compile(r"^\s*(%[\w]+) = torch\.constant\.int (-?\d+)", re.M)


def with_index_constants(body: str) -> str:
    """`body` (a kernel function's MLIR naming its index constants `%c<N>w`) with those constants defined first."""
    constants = sorted({int(c) for c in re.findall(r"%c(\d+)w\b", body)})
    return "\n".join([*(f"%c{c}w = arith.constant {c} : index" for c in constants), body])


def executable(name: str, bindings: str, rows: int, body: str) -> str:
    """A `stream.executable` whose export and function are both named `name` (unique in a module once IREE links the
    executables: findings 52), taking `bindings` (and, for `rows` 0, the row count as an index), over `%count`
    workgroups; `body` is the function's MLIR."""
    dynamic = "" if rows else ", %rows: index"
    indented = "\n".join("        " + line for line in body.splitlines())
    return f"""  stream.executable private @{name} {{
    stream.executable.export public @{name} workgroups(%count: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %count, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func @{name}({bindings}{dynamic}) {{
{indented}
      }}
    }}
  }}"""


def _tensor(vtensor: str) -> tuple[str, list[str]]:
    dims, dtype = _TYPE.fullmatch(vtensor.strip()).groups()
    sizes = dims.split(",") if dims else []
    return f"tensor<{'x'.join([*sizes, _DTYPES[dtype]])}>", sizes


#: what a kernel's `convert` gives `splice_each` for one call: its lines, the executable's name and text
Spliced = tuple[list[str], str, str]


def splice_each(mlir: str, mark: str, what: str, convert: Callable[[str, dict[str, str]], Spliced]) -> str:
    """`mlir` with every line naming `mark` replaced by `convert(line, ints)`'s lines (`ints`: the module's
    `torch.constant.int` values by SSA name), the executables it names declared once at the module's start.
    `convert` raises ValueError for a call it cannot take; ValueError "no <what> call in the module" where none is."""
    ints = dict(_INT.findall(mlir))
    out, executables = [], {}
    for line in mlir.splitlines():
        if mark not in line:
            out.append(line)
            continue
        lines, name, text = convert(line, ints)
        executables[name] = text
        out += lines
    if not executables:
        raise ValueError(f"no {what} call in the module")
    start = next(i for i, line in enumerate(out) if line.startswith("module"))
    return "\n".join([*out[: start + 1], *executables.values(), *out[start + 1 :]])


def dispatch_lines(
    pad: str, prefix: str, name: str, operands: list[tuple[str, str]], count: int, result: str, res: str, otype: str
) -> list[str]:
    """The lines of a static call of executable `name` over `count` workgroups: each operand (SSA value, its
    `!torch.vtensor` type) converted to a builtin tensor, the `flow.dispatch` giving `result` (a builtin tensor
    type), converted back to `res` of type `otype`; `prefix` names the SSA values added."""
    lines, values, types = [], [], []
    for i, (value, vtype) in enumerate(operands):
        builtin = _tensor(vtype)[0]
        lines.append(f"{pad}%{prefix}_{i} = torch_c.to_builtin_tensor {value} : {vtype} -> {builtin}")
        values.append(f"%{prefix}_{i}")
        types.append(builtin)
    return [
        *lines,
        f"{pad}%{prefix}_n = arith.constant {count} : index",
        f"{pad}%{prefix}_d = flow.dispatch @{name}::@{name}[%{prefix}_n]({', '.join(values)}) : "
        f"({', '.join(types)}) -> {result}",
        f"{pad}{res} = torch_c.from_builtin_tensor %{prefix}_d : {result} -> {otype.strip()}",
    ]


def splice_calls(
    mlir: str,
    mark: str,
    tensors: int,
    build: Callable[[int, int, int, int, int], tuple[str, str]],
    prefix: str,
    columns: Callable[[int, int, int], int] | None = None,
) -> str:
    """`mlir` with every `torch.operator "<mark>"` call of `tensors` tensors (x [rows, K] f32 or i8 first) and three
    ints (n, tile, per) replaced by a `flow.dispatch` writing [rows, N] f32 over ceil(N / (8 tile) / per)
    workgroups; `build(rows, n, k, tile, per)` gives the executable's name and text (rows 0: dynamic); `prefix`
    names the SSA values it adds. `columns(k, n, tile)`, where given, is the row stride the executable reads x with:
    where it exceeds K, x's static rows are copied to rows of that stride before the dispatch (`_row_copy`'s
    dispatch: 14 us for 128 x 1024, where IREE 3.13's `tensor.pad` read ~0.1 ms more). ValueError where
    there is no call, or one of another form."""
    call = re.compile(rf'^(\s*)(%[\w]+) = torch\.operator "{re.escape(mark)}"\(([^)]*)\) : \((.*)\) -> (.*)$')
    unknown = f"an {mark.rsplit('.', 1)[-1]} call of an unknown form"

    def convert(line: str, ints: dict[str, str]) -> Spliced:
        found = call.match(line)
        if not found or len(found.group(3).split(", ")) != tensors + 3:
            raise ValueError(f"{unknown}: {line.strip()[:200]}")
        pad, res, operands, types, otype = found.groups()
        names = operands.split(", ")
        vtypes = re.findall(r"!torch\.vtensor<[^>]*>", types)[:tensors]
        if len(vtypes) != tensors or any(c not in ints for c in names[tensors:]):
            raise ValueError(f"{unknown}: {line.strip()[:200]}")
        typed = [_tensor(t) for t in vtypes]
        n, tile, per = (int(ints[c]) for c in names[tensors:])
        rows_s, k = typed[0][1][0], int(typed[0][1][1])
        rows = 0 if rows_s == "?" else int(rows_s)
        name, text = build(rows, n, k, tile, per)
        v, out = f"{prefix}{res[1:]}", []
        for i, (operand, vt, (tt, _)) in enumerate(zip(names[:tensors], vtypes, typed, strict=True)):
            out.append(f"{pad}%{v}_{i} = torch_c.to_builtin_tensor {operand} : {vt} -> {tt}")
        out.append(f"{pad}%{v}_n = arith.constant {-(-n // (8 * tile) // per)} : index")
        ops = ", ".join(f"%{v}_{i}" for i in range(tensors))
        sig = ", ".join(tt + (f"{{%{v}_r}}" if "?" in sizes else "") for tt, sizes in typed)
        ld = columns(k, n, tile) if columns else k
        if ld != k:
            if not rows or k % _PAD_LANES:
                raise ValueError(f"{unknown}: x's rows padded to {ld} need static rows, K a multiple of {_PAD_LANES}")
            copy, padded = f"rows_{rows}x{k}_to_{ld}", f"tensor<{rows}x{ld}xf32>"
            pads[copy] = executable(copy, "%bx: !stream.binding, %bo: !stream.binding", rows, _row_copy(rows, k, ld))
            out += [
                f"{pad}%{v}_pn = arith.constant {-(-rows // _PAD_ROWS)} : index",
                f"{pad}%{v}_p = flow.dispatch @{copy}::@{copy}[%{v}_pn](%{v}_0) : ({typed[0][0]}) -> {padded}",
            ]
            ops, sig = ops.replace(f"%{v}_0", f"%{v}_p", 1), sig.replace(typed[0][0], padded, 1)
        if not rows:
            out += [f"{pad}%{v}_z = arith.constant 0 : index",
                    f"{pad}%{v}_r = tensor.dim %{v}_0, %{v}_z : {typed[0][0]}"]  # fmt: skip
            ops, sig = f"{ops}, %{v}_r", f"{sig}, index"
        result = f"tensor<{rows_s}x{n}xf32>" + ("" if rows else f"{{%{v}_r}}")
        out += [
            f"{pad}%{v}_d = flow.dispatch @{name}::@{name}[%{v}_n]({ops}) : ({sig}) -> {result}",
            f"{pad}{res} = torch_c.from_builtin_tensor %{v}_d : tensor<{rows_s}x{n}xf32> -> {otype.strip()}",
        ]
        return out, name, text

    pads: dict[str, str] = {}
    mlir = splice_each(mlir, mark, mark.removeprefix("torch."), convert)
    if pads:
        start = mlir.index("\n", re.search(r"^module", mlir, re.M).start())
        mlir = "\n".join([mlir[:start], *pads.values()]) + mlir[start:]
    return mlir


#: the row copy's vector (x's columns read a vector at a time) and rows a workgroup
_PAD_LANES, _PAD_ROWS = 16, 16


def _row_copy(rows: int, k: int, ld: int) -> str:
    """A function body copying x [rows, k] f32 into [rows, ld] (`_PAD_ROWS` rows a workgroup; columns k.. ld
    not written: the kernel reading it never reads them)."""
    vec = f"vector<{_PAD_LANES}xf32>"
    return with_index_constants(
        "\n".join(
            [
                "%c0 = arith.constant 0 : index",
                "%c1 = arith.constant 1 : index",
                f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<{rows * k}xf32>",
                f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> memref<{rows * ld}xf32>",
                "%wg = stream.dispatch.workgroup.id[0] : index",
                f"%r0 = arith.muli %wg, %c{_PAD_ROWS}w : index",
                f"%r1p = arith.addi %r0, %c{_PAD_ROWS}w : index",
                f"%r1 = arith.minui %r1p, %c{rows}w : index",
                "scf.for %r = %r0 to %r1 step %c1 {",
                f"%xo = arith.muli %r, %c{k}w : index",
                f"%oo = arith.muli %r, %c{ld}w : index",
                f"scf.for %j = %c0 to %c{k}w step %c{_PAD_LANES}w {{",
                "%xa = arith.addi %xo, %j : index",
                "%oa = arith.addi %oo, %j : index",
                f"%v = vector.load %xm[%xa] : memref<{rows * k}xf32>, {vec}",
                f"vector.store %v, %om[%oa] : memref<{rows * ld}xf32>, {vec}",
                "}",
                "}",
                "return",
            ]
        )
    )
