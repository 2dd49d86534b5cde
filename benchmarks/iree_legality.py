"""Which ATen ops IREE lowers, measured: writes backends/iree/legality_data.py.

Two sources, nothing guessed:

1. The OpInfo corpus's results (`opinfo_corpus.py`, JSON lines): every graph
   IREE compiled proves its ops lower (in that form); every compile or import
   error is charged to the op it names (the failing node's op, the
   `torch.aten.*` op that failed to legalize) or, in a graph of one op, to
   that op.
2. The FX importer's own dialect: an ATen op torch-mlir does not register is
   imported as an opaque `torch.operator`, which IREE 3.13 never lowers
   (the corpus checks this: no such op compiled). Asked of every op torch can
   decompose, so ops the corpus never met are covered too.

An op is `illegal` when a graph of that op alone ran on IREE after the rules
and gave other numbers than eager (a wrong number is worse than an error),
when it failed and never compiled, or when it is unregistered and never
compiled; `partial` when it compiled in some forms and failed in others
(those ops are left alone: their failures depend on the arguments).

    python benchmarks/opinfo_corpus.py                  # the corpus first (about an hour on 2 cores)
    python benchmarks/iree_legality.py [--results .corpus/opinfo.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch._decomp
from torch._ops import OpOverload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import opinfo_table  # noqa: E402

OUT = ROOT / "backends" / "iree" / "legality_data.py"
#: graph entries that are not ops IREE lowers or fails on
_NOT_OPS = {"getitem", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset"}


def mlir_name(op: OpOverload) -> str:
    """The importer's name for `op` without "torch.": aten.nll_loss_nd, aten.xlogy.Tensor."""
    ns, _, name = op._schema.name.partition("::")
    overload = op._schema.overload_name
    return f"{ns}.{name}" + (f".{overload}" if overload else "")


def _op_from_mlir(name: str) -> str | None:
    """ "aten.nll_loss_nd" (the importer's name) -> "aten.nll_loss_nd.default"."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] not in ("aten", "prims"):
        return None
    packet = getattr(getattr(torch.ops, parts[0]), parts[1], None)
    if packet is None:
        return None
    overload = parts[2] if len(parts) > 2 else "default"
    return f"{parts[0]}.{parts[1]}.{overload}" if overload in packet.overloads() else None


def _charge(column: dict[str, Any], ops: list[str]) -> str | None:
    """The op a failure is charged to, or None."""
    if column.get("node_op", "").startswith(("aten.", "prims.")):
        return column["node_op"]
    named = _op_from_mlir(column.get("op", "")) if column.get("op") else None
    return named or _single(ops)


_LOCATION = re.compile(r"^.*? at (<unknown>|\?|/\S+|iree-lld)(:\d+)*: ")


def _reason(why: str) -> str:
    """The compiler's or importer's own words, without our error's framing and the location."""
    why = _LOCATION.sub(
        "", why.split(". Hint:")[0].removeprefix("IreeCompileError: ").removeprefix("IreeImportError: ")
    )
    return " ".join(why.split())[:140]


def _single(ops: list[str]) -> str | None:
    """The op of a graph of one op (getitem and sizes aside), else None."""
    real = [o for o in ops if o.split(".")[0] in ("aten", "prims") and o.split(".")[1] not in _NOT_OPS]
    return real[0] if len(real) == 1 else None


def measure(records: list[dict[str, Any]]) -> tuple[dict[str, int], dict[str, list[str]], dict[str, list[str]]]:
    """(times each op compiled, the failures charged to each op, the wrong results of each op: graphs of that
    op alone that ran on IREE after the rules and differ from eager)."""
    compiled: dict[str, int] = defaultdict(int)
    failed: dict[str, list[str]] = defaultdict(list)
    wrong: dict[str, list[str]] = defaultdict(list)
    for r in records:
        if r.get("status") != "checked" or opinfo_table.uninitialised(r):
            continue
        for column, ops in (("exported", r.get("ops", [])), ("after", r.get("ops_after", []))):
            state = r.get(column)
            if not state:
                continue
            if state["status"] == "wrong" and column == "after" and _single(ops):
                wrong[_single(ops)].append(f"{r['op']} ({r['variant']}): {state.get('why', '')[:120]}")
            elif state["status"] in ("pass", "wrong", "run"):
                for op in ops:
                    compiled[op] += 1
            elif state["status"] in ("compile", "import"):
                op = _charge(state, ops)
                if op is not None:
                    failed[op].append(f"{r['op']}: {_reason(state.get('why', ''))}")
    return compiled, failed, wrong


def decomposable() -> list[OpOverload]:
    """Every ATen op torch can decompose: its torch._decomp entry or CompositeImplicitAutograd kernel."""
    ops = {op for op in torch._decomp.decomposition_table if isinstance(op, OpOverload)}
    for qualified in torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"):
        ns, _, rest = qualified.partition("::")
        name, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, ns, None), name, None)
        if packet is not None and (overload or "default") in packet.overloads():
            ops.add(getattr(packet, overload or "default"))
    return sorted((op for op in ops if op.namespace in ("aten", "prims")), key=str)


def _compiler_mentions() -> set[str]:
    """`torch.aten.*` names the IREE compiler library spells out: its dialect's ops and the `torch.operator`
    names its own patterns convert (aten._scaled_dot_product_flash_attention_for_cpu, for one)."""
    import iree.compiler

    library = Path(iree.compiler.__file__).parent / "_mlir_libs" / "libIREECompiler.so"
    return {m.decode() for m in re.findall(rb"torch\.(?:aten|prims)\.[A-Za-z0-9_.]+", library.read_bytes())}


def unregistered(ops: list[OpOverload]) -> set[str]:
    """The ops of `ops` the FX importer emits as `torch.operator` (not in torch-mlir's dialect) and that the
    compiler has no pattern for (its library never names them)."""
    from iree.compiler import ir
    from iree.compiler.extras import fx_importer

    context = ir.Context()
    fx_importer.FxImporter(context=context)
    named = _compiler_mentions()
    return {
        str(op)
        for op in ops
        if not context.is_registered_operation(f"torch.{mlir_name(op)}") and f"torch.{mlir_name(op)}" not in named
    }


def classify(records: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str], set[str], dict[str, int]]:
    """(illegal: op -> why, partial: op -> what was seen, decomposable ops torch-mlir lacks, times compiled)."""
    compiled, failed, wrong = measure(records)
    ops = decomposable()
    opaque = unregistered(ops)
    illegal: dict[str, str] = {}
    partial: dict[str, str] = {}
    for op, whys in sorted(wrong.items()):  # a wrong number is worse than an error: decompose wherever possible
        illegal[op] = f"wrong numbers {len(whys)}x; {whys[0]}"
    for op, whys in sorted(failed.items()):
        if op in illegal:
            continue
        if compiled.get(op):
            partial[op] = f"compiled {compiled[op]}x, failed {len(whys)}x; {whys[0]}"
        else:
            illegal[op] = f"failed {len(whys)}x; {whys[0]}"
    contradicted = sorted(op for op in opaque if compiled.get(op))
    if contradicted:
        print(f"unregistered ops that compiled (kept legal): {contradicted}", file=sys.stderr)
    opaque = {op for op in opaque if op not in illegal and op not in partial and not compiled.get(op)}
    return illegal, partial, opaque, dict(compiled)


def write(
    illegal: dict[str, str], partial: dict[str, str], opaque: set[str], compiled: dict[str, int], sources: list[str]
) -> None:
    header = f'''"""ATen ops IREE {version("iree-base-compiler")} cannot lower, measured; generated, do not edit.

Regenerate with `python benchmarks/iree_legality.py` after a corpus run
(`python benchmarks/opinfo_corpus.py`); torch {version("torch")}. Sources: {", ".join(sources)}
and torch-mlir's dialect as the FX importer sees it.
"""

IREE_VERSION = {json.dumps(version("iree-base-compiler"))}
TORCH_VERSION = {json.dumps(version("torch"))}
'''

    def mapping(name: str, doc: str, items: dict[str, str]) -> list[str]:
        lines = [f"#: {doc}", f"{name}: dict[str, str] = {{"]
        lines += [f"    {json.dumps(op)}: {json.dumps(why)}," for op, why in sorted(items.items())]
        return [*lines, "}", ""]

    def names(name: str, doc: str, items: Iterable[str]) -> list[str]:
        lines = [f"#: {doc}", f"{name}: frozenset[str] = frozenset(", "    {"]
        lines += [f"        {json.dumps(op)}," for op in sorted(items)]
        return [*lines, "    }", ")", ""]

    body = [
        header,
        *mapping("ILLEGAL", "op -> why: failed in every form the corpus met, never compiled", illegal),
        *mapping("PARTIAL", "op -> what was seen: compiled in some forms, failed in others (left alone)", partial),
        *names(
            "OPAQUE", "ops torch decomposes, not in torch-mlir (imported as torch.operator), never compiled", opaque
        ),
        *names("LOWERED", "ops seen compiling in the corpus", compiled),
    ]
    OUT.write_text("\n".join(body))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="+", default=[str(ROOT / ".corpus" / "opinfo.jsonl")])
    args = parser.parse_args(argv)
    records = []
    for path in args.results:
        records.extend(json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    illegal, partial, opaque, compiled = classify(records)
    write(illegal, partial, opaque, compiled, [Path(p).name for p in args.results])
    print(f"{len(illegal)} failing, {len(opaque)} not in torch-mlir, {len(partial)} partial, {len(compiled)} compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
