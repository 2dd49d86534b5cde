"""The properties every generated module must keep through `fx_rewrites.apply`.

`check_default(spec)`: export (the input's dims in `spec.dynamic` with Dim.AUTO), apply DEFAULT, then
- the run converged with no skipped rule, and the graph lints;
- the rewritten program matches eager (outputs, mutated input, buffers after the call);
- applying DEFAULT again rewrites nothing (idempotent);
- the program saves and loads (torch.export.save/load), and the loaded one matches eager.
`check_iree(spec)`: the same module through the IREE backend's rules and compiler.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import attrs
import torch
from hypothesis import reject

import fx_rewrites
from tests.fuzz.generate import ATOL, RTOL, FuzzNet, Spec, fresh


def export(spec: Spec) -> tuple[FuzzNet, torch.export.ExportedProgram, Spec]:
    """The module, its export, and the spec narrowed to the dims that stayed dynamic (`Spec.exported`)."""
    # torch 2.13 keeps state between exports that can make a later export with a Dim batch and torch.cond
    # fail ("specialized it to be a constant"); a fresh dynamo state per case (docs/reliability.md)
    torch._dynamo.reset()
    net = FuzzNet(spec).eval()
    args = spec.inputs()[0]
    try:
        ep = torch.export.export(fresh(net), tuple(a.clone() for a in args), dynamic_shapes=spec.dynamic_shapes())
    except RuntimeError as e:
        # torch 2.13 cannot export a cond over a slice with Dim sizes: it compares the branches' strides as
        # written (`4*Max(1, s53 - 1)`) and rejects equal ones ("cond's output stride is not a simple
        # accumulative multiplication of sizes", seed 31). torch's limit, not the rules'
        if "cond's output stride" in str(e):
            reject()
        raise
    spec = spec.exported(ep)
    if spec.dynamic and not _guards_accept(ep, spec.inputs()[1]):
        spec = attrs.evolve(spec, dynamic=())  # export kept the dims symbolic but guarded them to few sizes
    if spec.dynamic and _symbolic_size_of_one(ep):
        spec = attrs.evolve(spec, dynamic=())
        torch._dynamo.reset()
        ep = torch.export.export(fresh(net), tuple(a.clone() for a in args))
    return net, ep, spec


def _symbolic_size_of_one(program: torch.export.ExportedProgram) -> bool:
    """Whether a value of the program has a symbolic size that is 1 in the example (`narrow(0, 1, batch - 1)`
    at batch 2). torch specialises any functional op computed on such a value (export of `v * 2` fixes the
    batch: 'Guard failed: -1 + x.size()[0] == 1'), and the in-place rules make such ops, so the engine
    refuses with a named error (`values.Specialised`); those cases are checked with static sizes."""
    for node in program.graph.nodes:
        val = node.meta.get("val")
        for size in getattr(val, "shape", ()):
            if isinstance(size, torch.SymInt) and size.node.hint == 1:
                return True
    return False


def _guards_accept(program: torch.export.ExportedProgram, args: tuple[torch.Tensor, ...]) -> bool:
    """Whether the exported program's own guards take `args`: export may keep a dim symbolic with a guard
    that allows few sizes (`y[::2].narrow(0, 0, 1)` on a Dim batch of 2: `(1 + batch) // 2 == 1`)."""
    try:
        copy.deepcopy(program).module()(*(a.clone() for a in args))
    except AssertionError as e:
        if str(e).startswith("Guard failed"):
            return False
        raise
    return True


def _eager(net: FuzzNet, args: tuple[torch.Tensor, ...]) -> tuple[Any, tuple[torch.Tensor, ...], dict]:
    """Outputs, the inputs after the call and the buffers after the call, from a fresh copy."""
    module, args = fresh(net), tuple(a.clone() for a in args)
    out = module(*args)
    return out, args, dict(module.named_buffers())


def _program(program: torch.export.ExportedProgram, args: tuple[torch.Tensor, ...]) -> tuple[Any, tuple, dict]:
    module, args = copy.deepcopy(program).module(), tuple(a.clone() for a in args)  # .module() shares the state
    out = module(*args)
    return out, args, dict(module.named_buffers())


def assert_matches(program: torch.export.ExportedProgram, net: FuzzNet, spec: Spec, what: str) -> None:
    for n, args in enumerate(spec.inputs()):
        expected = _eager(net, args)
        got = _program(program, args)
        for name, g, e in zip(("outputs", "inputs after the call", "buffers after the call"), got, expected):
            torch.testing.assert_close(
                g,
                e,
                rtol=RTOL,
                atol=ATOL,
                equal_nan=True,
                msg=lambda m, name=name, n=n: f"{what}, input set {n}, {name}: {m}",
            )


def _saved_and_loaded(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def check_default(spec: Spec) -> Spec:
    """The checks above; returns the spec narrowed to the dims that stayed dynamic."""
    net, ep, spec = export(spec)
    result = fx_rewrites.apply(ep)
    report = result.report
    assert report.converged and not report.skips, report.summary()
    result.graph_module.graph.lint()
    assert result.program is not None
    assert_matches(result.program, net, spec, "after DEFAULT")
    again = fx_rewrites.apply(result.program)
    assert again.report.total_rewrites == 0, f"second apply rewrote again: {dict(again.report.rewrites)}"
    assert_matches(_saved_and_loaded(result.program), net, spec, "after save and load")
    return spec


def check_iree(spec: Spec, backend: Any) -> Spec:
    net, ep, spec = export(spec)
    result = fx_rewrites.apply(ep, backend.rules)
    assert result.report.converged and not result.report.skips, result.report.summary()
    for n, inputs in enumerate(spec.inputs()):
        # a fresh copy each time: the compiled module writes buffer mutations into the program's state
        compiled = backend.compile(copy.deepcopy(result.program), inputs)
        expected = _eager(net, inputs)
        run_args = tuple(a.clone() for a in inputs)
        got = (compiled(*run_args), run_args)
        for name, g, e in zip(("outputs", "inputs after the call"), got, expected):
            torch.testing.assert_close(
                g,
                e,
                rtol=RTOL,
                atol=ATOL,
                equal_nan=True,
                msg=lambda m, name=name, n=n: f"IREE, input set {n}, {name}: {m}",
            )
    return spec
