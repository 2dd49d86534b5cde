"""What the localizer says and writes: the report, a standalone reproduction, a guard-rule skeleton and its test.

The reproduction is Python only (no pickles): the failing piece as a function of aten calls, its inputs from
a seed (small tensors written out exactly, larger ones drawn over the recorded range), the backend's compile
and the comparison against eager and float64. It exits 1 when it reproduces the finding, 0 when not.
"""

from __future__ import annotations

import json
import math
import operator
import pprint
import re
import textwrap
from typing import Any

import torch
from torch.fx import GraphModule, Node

from fx_rewrites.explain import format_value
from fx_rewrites.schema import op_name

#: tensors up to this many elements are written out exactly; larger ones drawn from the seed
EXACT = 64


def source_line(node: Node) -> str:
    """ "model.py:9 in forward: `z = F.gelu(y)`" from the node's stack trace, and the rule that made the node."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    made = [r.get("rule") for r in node.meta.get("rewrites", ()) if isinstance(r, dict)]
    made = [getattr(r, "name", r) for r in made]
    by = f" (a node made by the rule {made[-1]})" if made else ""
    if frames:
        path, line, fn, code = frames[-1]
        return f"{path}:{line} in {fn}: `{code.strip()}`{by}"
    return f"none recorded{by}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shapes(values: list[Any]) -> str:
    return ", ".join(format_value(v) for v in values) or "none"


def report(loc: Any) -> str:
    """The localization as text for a terminal."""
    how = "after the backend's rules" if loc.rules else "as exported (no rules)"
    out = [
        f"fx-rewrites localize: {loc.label} on {loc.backend}, {how}",
        f"the program as a whole on {loc.backend}: {textwrap.shorten(loc.whole, 300)}",
        f"searched {loc.nodes} nodes{DYNAMIC if loc.dynamic else ''}: {loc.compiles} compiles, {loc.seconds:.1f} s",
    ]
    f = loc.finding
    if loc.note:
        out.append(f"note: {loc.note}")
    if loc.skipped:
        out.append(f"not checked ({len(loc.skipped)} nodes torch could not rebuild as a piece of their own):")
        out += [f"  {n.name} ({op_name(n.target)}): {textwrap.shorten(why, 200)}" for n, why in loc.skipped[:5]]
    if f is None:
        every = "every node" if not loc.skipped else "every node checked"
        both = ", with the recorded sizes and with the program's symbolic shapes" if loc.dynamic else ""
        out.append(f"PASS: {loc.backend} matches eager on {every}{both} (each output within its dtype's tolerance)")
        return "\n".join(out)
    node = f.node
    where = f"node {node.name} ({f.op})" if len(f.nodes) == 1 else f"{len(f.nodes)} nodes from {node.name} on"
    only = ", wrong only with dynamic shapes (every piece with the recorded, static sizes is right)"
    out.append(f"FOUND: {where}: {f.kind} on {loc.backend}{only if f.symbolic else ''}")
    if len(f.nodes) > 1:
        out.append(
            "  no smaller piece fails; together: " + ", ".join(f"{n.name} ({op_name(n.target)})" for n in f.nodes)
        )
    out.append(f"  source: {source_line(node)}")
    out.append(f"  inputs: {_shapes(f.inputs)}")
    if f.symbolic:
        from fx_rewrites.app.localize.dynamic import dims_source

        out.append(f"  symbolic shapes the backend compiled: {textwrap.shorten(f.symbolic, 600)}")
        static = dims_source(f.piece)[1]
        dynamic = "repro.py exports the piece with these dims as torch.export Dims"
        out.append(f"  {STATIC_REPRO}: {static}" if static else f"  {dynamic}")
    value = node.meta.get("val")
    if value is not None:
        out.append(f"  output: {format_value(value)}")
    if f.error:
        out.append(f"  error: {textwrap.shorten(f.error, 900)}")
    j = f.judgement
    if j is not None:
        out.append(f"  {j.reason}")
        if j.vs_eager is not None:
            out.append(f"  vs eager: max abs diff {j.vs_eager:.2e}")
        if j.backend_error is not None:
            ratio = j.backend_error / j.torch_error if j.torch_error else math.inf
            out.append(
                f"  vs float64 (the op on the recorded inputs in float64): {loc.backend} {j.backend_error:.2e}, "
                f"torch {_dtype(j.dtype)} {j.torch_error:.2e} ({ratio:.0f}x)"
            )
    if f.refused:
        out.append(f"  the {loc.backend} backend refuses this form by default: {textwrap.shorten(f.refused, 400)}")
    for path in loc.written:
        out.append(f"wrote {path}")
    if loc.reproduced is not None:
        out.append(f"the reproduction reproduces it here: {'yes' if loc.reproduced else 'NO (see repro.py)'}")
    return "\n".join(out)


#: the search line's words for a search that ran its dynamic pass too
DYNAMIC = " with the recorded sizes, then with the program's symbolic shapes"

#: what the report says of a dynamic-only finding's reproduction
STATIC_REPRO = (
    "the reproduction (repro.py) is static, it compiles the piece with the recorded sizes and may not reproduce "
    "a dynamic-only fault (Finding.piece, whose values carry the symbolic shapes, does)"
)


# ----------------------------------------------------------------------------- Python text


def quoted(text: str) -> str:
    """A Python string literal in double quotes (the project's style)."""
    return json.dumps(text)


def literal(v: Any) -> str:
    """`v` as Python source that builds it."""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else f"float({quoted(str(v))})"
    if isinstance(v, str):
        return quoted(v)
    if v is None or isinstance(v, (bool, int)):
        return repr(v)
    if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
        return str(v)
    if isinstance(v, torch.device):
        return f"torch.device({quoted(str(v))})"
    if isinstance(v, list):
        return f"[{', '.join(literal(x) for x in v)}]"
    if isinstance(v, tuple):
        return f"({', '.join(literal(x) for x in v)}{',' if len(v) == 1 else ''})"
    if isinstance(v, Node):
        return v.name
    raise ValueError(f"cannot write {type(v).__name__} {v!r} as Python")


def _callee(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    if target.__module__ == "_operator":  # size arithmetic (a dynamic piece's)
        return f"operator.{target.__name__}"
    return f"{target.__module__}.{target.__qualname__}"


def program_source(piece: GraphModule) -> str:
    """The piece as `def program(...)` of torch.ops calls."""
    params = [n.name for n in piece.graph.nodes if n.op == "placeholder"]
    body = []
    for n in piece.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            body.append(f"{n.name} = {literal(n.args[0])}[{literal(n.args[1])}]")
        elif n.op == "call_function":
            args = [literal(a) for a in n.args] + [f"{k}={literal(v)}" for k, v in n.kwargs.items()]
            body.append(f"{n.name} = {_callee(n.target)}({', '.join(args)})")
        elif n.op == "output":
            body.append(f"return {literal(tuple(n.args[0]))}")
        elif n.op != "placeholder":
            raise ValueError(f"cannot write the {n.op} node {n.name} as Python (a subgraph)")
    return f"def program({', '.join(params)}):\n" + textwrap.indent("\n".join(body), "    ")


def _drawn(t: torch.Tensor) -> str:
    """An expression drawing a tensor like `t` from the generator `g`: over its range, of its shape and dtype."""
    shape, dtype = list(t.shape), str(t.dtype)
    if t.dtype == torch.bool:
        return f"torch.randint(0, 2, {shape}, generator=g).bool()"
    if t.is_complex():
        return f"torch.randn({shape}, dtype={dtype}, generator=g)"
    finite = t[torch.isfinite(t)] if t.is_floating_point() else t
    low, high = (finite.min().item(), finite.max().item()) if finite.numel() else (0, 1)
    if t.is_floating_point():
        if low == high:
            return f"torch.full({shape}, {literal(float(low))}, dtype={dtype})"
        return f"torch.empty({shape}, dtype={dtype}).uniform_({low!r}, {high!r}, generator=g)"
    return f"torch.randint({int(low)}, {int(high) + 1}, {shape}, dtype={dtype}, generator=g)"


def input_source(name: str, t: torch.Tensor | int) -> str:
    """Lines making a tensor like `t`: with seed 0 its recorded values when small, else drawn over its range
    (a number, a size the piece reads: as recorded)."""
    if not isinstance(t, torch.Tensor):
        return f"{name} = {literal(t)}"
    if t.numel() > EXACT:
        return f"{name} = {_drawn(t)}"
    values = pprint.pformat(t.tolist(), width=100, compact=True).replace("nan", 'float("nan")')
    values = re.sub(r"(?<![\w\"])(-?)inf\b", r'\1float("inf")', values)
    values = textwrap.indent(values, " " * 8).strip()
    exact = f"torch.tensor(\n        {values},\n        dtype={t.dtype},\n    ).reshape({list(t.shape)})"
    return f"if seed == 0:  # the values recorded\n    {name} = {exact}\nelse:\n    {name} = {_drawn(t)}"


def inputs_source(piece: GraphModule, inputs: list[Any]) -> str:
    names = [n.name for n in piece.graph.nodes if n.op == "placeholder"]
    lines = ["g = torch.Generator().manual_seed(seed)"]
    lines += [input_source(name, t) for name, t in zip(names, inputs)]
    lines.append(f"return ({', '.join(names)}{',' if len(names) == 1 else ''})")
    return "def inputs(seed=0):\n" + textwrap.indent("\n".join(lines), "    ")


#: the comparison the reproduction and the guard's test make (as `compare.judge`, written out)
WRONG = '''
def wrong(got, expected, reference):
    """Why the backend's output is wrong ("" if right): its error against float64 over 10x torch's own."""
    if got.shape != expected.shape:
        return f"shape {list(got.shape)} where eager's is {list(expected.shape)}"
    if not expected.is_floating_point():
        return "" if torch.equal(got.to(expected.dtype), expected) else "values differ from eager's"
    g, e, r = got.double(), expected.double(), reference.double()
    if not torch.equal(g.isnan(), e.isnan()) or not torch.equal(g.isinf() & (g != e), e.isinf() & (g != e)):
        return "NaN or inf where eager's is not"
    keep = g.isfinite() & e.isfinite() & r.isfinite()
    g, e, r = g[keep], e[keep], r[keep]
    if not g.numel():
        return ""
    ours, theirs = (g - r).abs().max().item(), (e - r).abs().max().item()
    floor = 8 * torch.finfo(expected.dtype).eps * max(1.0, r.abs().max().item())
    if ours > 10 * theirs + floor:
        return f"off by {ours:.2e} against float64 where torch is off by {theirs:.2e}"
    return ""
'''


def _backend_source(backend: str) -> str:
    return (
        f"backend = backends.get({quoted(backend)})\n"
        'if getattr(backend, "refuse_wrong_forms", False):  # IREE itself, not its refusal of known wrong forms\n'
        "    backend = attrs.evolve(backend, refuse_wrong_forms=False)\n"
        'if hasattr(backend, "for_demo"):  # ttnn without ttnn: its host emulation\n'
        "    backend = backend.for_demo()"
    )


def repro_source(loc: Any) -> str:
    from fx_rewrites.app.localize.dynamic import dims_source

    f = loc.finding
    dims = dims_source(f.piece)[0] if f.symbolic else "def dynamic_shapes():\n    return None  # the recorded sizes"
    what = f"{f.kind} on {loc.backend}: node {f.node.name} ({f.op}), source {source_line(f.node)}"
    return f'''"""Reproduction written by `fx-rewrites localize` for {loc.label}.

{textwrap.fill(what, 110)}
Run: python repro.py   (exit 1: reproduced; exit 0: not)
"""

import inspect
import operator
import sys

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fx_rewrites import backends

{_backend_source(loc.registered or loc.backend)}


{program_source(f.piece)}


{inputs_source(f.piece, f.inputs)}

{WRONG}

def upcast(args):
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def fresh(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


{dims}


class Program(torch.nn.Module):
    def forward(self, *args):
        return program(*args)


def traced(args):
    """The program as the backend gets it: exported with dynamic_shapes()'s dims where it has them, else a
    GraphModule with the sizes of `args`."""
    shapes = dynamic_shapes()
    if shapes is not None:
        return torch.export.export(Program(), tuple(args), dynamic_shapes=shapes)
    module = torch.fx.symbolic_trace(program)
    lines, first = inspect.getsourcelines(program)
    body = [(first + i, text.strip()) for i, text in enumerate(lines) if " = " in text]
    for n, (line, text) in zip([n for n in module.graph.nodes if n.op == "call_function"], body):
        n.meta["stack_trace"] = f'  File "{{__file__}}", line {{line}}, in program\\n    {{text}}\\n'  # for errors
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        FakeTensorProp(module, mode).propagate_dont_convert_inputs(*fakes)
    for p, fake in zip([n for n in module.graph.nodes if n.op == "placeholder"], fakes):
        p.meta["val"] = fake
    return module


def main():
    args = inputs()
    module = traced(args)
    expected, reference = program(*args), program(*upcast(args))
    try:
        got = backend.compile(module, args)(*fresh(args))
    except Exception as e:
        text = " ".join(str(e).split())[:2000]
        print(f"REPRODUCED: {{backend.name}} fails on {f.op}: {{type(e).__name__}}: {{text}}")
        return 1
    for i, (g, e, r) in enumerate(zip(got, expected, reference)):
        why = wrong(g, e, r)
        if why:
            print(f"REPRODUCED: {{backend.name}} computes {f.op} wrong (output {{i}}): {{why}}")
            return 1
    print(f"not reproduced: {{backend.name}} matches eager on these inputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
