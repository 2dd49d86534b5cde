"""A guard-rule skeleton for a localized node and its test, in the style of backends/iree/rules/guards.py; `write`
puts them beside the reproduction (files.py).

The rule's `when` matches the op with the arguments measured; its body is left to write (it returns a Miss,
so the skeleton imports and runs). The test asserts the backend is wrong on the form without the rule and
right with it, on two input sets: it fails until the rewrite is written, and once the backend is fixed.
"""

from __future__ import annotations

import contextlib
import io
import re
import textwrap
from pathlib import Path
from typing import Any

import torch

from fx_rewrites.app.localize.files import (
    WRONG,
    _backend_source,
    inputs_source,
    literal,
    program_source,
    quoted,
    repro_source,
    source_line,
)
from fx_rewrites.schema import bind


def rule_name(op: torch._ops.OpOverload, backend: str) -> str:
    return re.sub(r"\W", "_", f"{op._schema.name.split('::')[1]}_for_{backend}")


def _root(op: torch._ops.OpOverload) -> str:
    name = f"{op._schema.name.split('::')[1]}.{op._overloadname}"
    return f"aten.{name}" if op.namespace == "aten" else f"torch.ops.{op.namespace}.{name}"


def _conditions(node: Any) -> list[str]:
    """`args.get(...) != value` for each argument that is not a tensor: a Miss unless it is as measured."""
    named = bind(node.target, node.args, dict(node.kwargs))
    out = []
    for key, value in named.items():
        try:
            text = literal(value)
        except ValueError:
            continue
        if isinstance(value, torch.fx.Node) or (isinstance(value, (list, tuple)) and _has_node(value)):
            continue
        out.append(f"args.get({quoted(key)}) {'is not' if value is None else '!='} {text}")
    return out


def _has_node(value: Any) -> bool:
    return any(isinstance(v, torch.fx.Node) for v in torch.utils._pytree.tree_leaves(value))


def guard_source(loc: Any) -> str:
    f = loc.finding
    op, node = f.node.target, next(n for n in f.piece.graph.nodes if n.op == "call_function")
    name = rule_name(op, loc.backend)
    checks = _conditions(node)
    when = "\n".join(
        [f"    if {c}:\n        return Miss({quoted('not the form measured: ' + c)})" for c in checks] or ["    pass"]
    )
    doc = f"{f.op}: {f.kind} on {loc.backend} (found by `fx-rewrites localize` in {loc.label})"
    return f'''"""A guard for {f.op} on {loc.backend}: a skeleton written by `fx-rewrites localize`.

{textwrap.fill(doc, 110)}.
Source: {source_line(f.node)}.
Move the rule beside the backend's guards (backends/iree/rules/guards.py for IREE) and write its body.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule

aten = torch.ops.aten


def _measured_form(node: Node, *, args: dict[str, Any]) -> bool | Miss:
    """The form {loc.backend} was measured wrong on; widen it once the rewrite is checked on more."""
{when}
    return True


@rule(
    roots=({_root(op)},),
    name={quoted(name)},
    when=_measured_form,
    priority=10,
    tags={{{quoted(loc.backend.split("-")[0])}, "guard"}},
    doc={quoted(doc)},
)
def {name}(node: Node, rw: Rewriter) -> Any:
    # TODO: rewrite the node into ops {loc.backend} computes right, e.g.
    #   rw.replace(node, rw.call(aten.some_op.default, *node.args))
    # (declare `*, args` to read its arguments by schema name; `*, found` for what a `when` returned)
    return Miss("not written yet: the skeleton's rewrite")
'''


def guard_test_source(loc: Any) -> str:
    from fx_rewrites.app.localize.dynamic import dims_source

    f = loc.finding
    dims = dims_source(f.piece)[0] if f.symbolic else "def dynamic_shapes():\n    return None  # the recorded sizes"
    name = rule_name(f.node.target, loc.backend)
    params = [n.name for n in f.piece.graph.nodes if n.op == "placeholder"]
    signature = ", ".join(params)
    return f'''"""The test of {name} (guard_rule.py), written by `fx-rewrites localize`: {loc.backend} is wrong on the
form without the rule (it fails once {loc.backend} is fixed and the guard can go) and right with it."""

import operator

import attrs
import torch
from guard_rule import {name}

from fx_rewrites import apply, backends

{_backend_source(loc.registered or loc.backend)}


{program_source(f.piece)}


class Form(torch.nn.Module):
    def forward(self, {signature}):
        return program({signature})


{inputs_source(f.piece, f.inputs)}


{dims}


def _export(args):
    shapes = dynamic_shapes()
    return torch.export.export(Form(), tuple(args), dynamic_shapes=None if shapes is None else shapes[0])

{WRONG}

def _wrong_on(program_, args):
    try:
        got = backend.compile(program_, args)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    except Exception as e:
        return f"{{type(e).__name__}}: {{e}}"
    expected = program(*args)
    reference = program(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args])
    return "; ".join(w for w in map(wrong, got, expected, reference) if w)


def test_the_backend_is_wrong_without_the_rule():
    args = inputs(0)
    assert _wrong_on(_export(args), args)


def test_the_rule_fires_and_the_backend_matches():
    for seed in (0, 1):
        args = inputs(seed)
        result = apply(_export(args), [{name}])
        assert result.report.rewrites.get({quoted(name)}), "the rule did not fire"
        assert not _wrong_on(result.program, args)
'''


# ----------------------------------------------------------------------------- writing


def write(loc: Any, out: Path, *, verify: bool = True) -> tuple[list[Path], bool | None]:
    """repro.py and, for one node, guard_rule.py and test_guard_rule.py in `out`; with `verify`, run repro.py's
    main() here: did it reproduce the finding?"""
    out.mkdir(parents=True, exist_ok=True)
    texts = {"repro.py": repro_source(loc)}
    if len(loc.finding.nodes) == 1 and isinstance(loc.finding.node.target, torch._ops.OpOverload):
        texts["guard_rule.py"] = guard_source(loc)
        texts["test_guard_rule.py"] = guard_test_source(loc)
    written = []
    for name, text in texts.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    if not verify:
        return written, None
    namespace: dict[str, Any] = {"__name__": "fx_rewrites_localize_repro", "__file__": str(out / "repro.py")}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(texts["repro.py"], str(out / "repro.py"), "exec"), namespace)
            return written, namespace["main"]() == 1
    except Exception:  # the script itself fails (a backend not registered by name): it does not reproduce
        return written, False
