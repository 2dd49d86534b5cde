"""One OpInfo sample as a tiny exported module, checked on IREE as exported and after the rules.

Used by `opinfo_corpus.py` (in worker processes) and tests/corpus (in CI); a check's findings are a dict.
"""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.export import Dim, ExportedProgram
from torch.utils import _pytree as pytree

import fx_rewrites
from fx_rewrites.backends.iree import IreeCompileError, IreeImportError, IreeUnsupportedError
from fx_rewrites.engine import RewriteError
from fx_rewrites.schema import op_name

#: float32 first; an op without it is tried in the first of these it supports
DTYPES = (torch.float32, torch.int64, torch.int32, torch.bool, torch.float64)
#: numerics: IREE's llvm-cpu code against eager torch on the same inputs
RTOL, ATOL = 1e-3, 1e-4
VARIANTS = ("static", "dynamic")


def op_key(op: Any) -> str:
    """The OpInfo's name, with its variant (`nn.functional.pad.reflect`)."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def load_ops() -> dict[str, Any]:
    """torch's OpInfo database by `op_key`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return {op_key(op): op for op in op_db}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def samples(op: Any, dtype: torch.dtype, count: int) -> list[Any]:
    """`count` of the op's sample inputs on the CPU (seeded): a new rank signature first."""
    torch.manual_seed(0)
    plain, odd = [], []
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        for s in op.sample_inputs("cpu", dtype, requires_grad=False):
            tensors = _tensors((s.input, s.args, s.kwargs))
            dense = all(t.layout == torch.strided for t in tensors)
            (plain if dense and all(t.numel() for t in tensors) else odd).append(s)
            if count == 1 and plain:  # the first plain sample is the one returned: the rest need not be made
                return plain
    # each new rank signature first (a 5-d reflect pad lowers unlike a 3-d one), in torch's order; samples
    # with empty or sparse tensors (edge cases no model meets) only when nothing else is left
    seen: set[tuple[int, ...]] = set()
    first, rest = [], []
    for s in plain:
        ranks = tuple(t.dim() for t in _tensors((s.input, s.args, s.kwargs)))
        (rest if ranks in seen else first).append(s)
        seen.add(ranks)
    return (first + rest + odd)[:count]


class OpModule(torch.nn.Module):
    """`fn(sample.input, *sample.args, **sample.kwargs)` with the sample's tensors as inputs and the
    rest (ints, dtypes, lists of sizes) baked in as constants."""

    def __init__(self, fn: Callable[..., Any], sample: Any) -> None:
        super().__init__()
        self.fn = fn
        leaves, self.spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
        self.positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.inputs = tuple(leaves[i] for i in self.positions)

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.template)
        for i, t in zip(self.positions, tensors):
            leaves[i] = t
        first, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(first, *args, **kwargs)

    def fresh_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in self.inputs)


def pick_dtype(op: Any) -> torch.dtype | None:
    supported = op.supported_dtypes("cpu")
    return next((d for d in DTYPES if d in supported), None)


def _short(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}"


def _graph_ops(program: ExportedProgram) -> list[str]:
    return sorted({op_name(n.target) for n in program.graph.nodes if n.op == "call_function"})


def _draws(node: Any) -> bool:
    """The node's op is tagged nondeterministic_seeded and its arguments do not turn the draw off
    (dropout_p=0 / p=0, train=False: scaled_dot_product_attention, dropout in eval)."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    named = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    named |= {a.name: v for a, v in zip(op._schema.arguments, node.args)} | dict(node.kwargs)
    off = named.get("dropout_p", named.get("p")) == 0 or named.get("train", named.get("training")) is False
    return not off


def _random_ops(program: ExportedProgram) -> list[str]:
    """Ops of the graph that draw random numbers."""
    return [op_name(n.target) for n in program.graph.nodes if n.op == "call_function" and _draws(n)]


def _is_dynamic(program: ExportedProgram) -> bool:
    values = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"]
    return any(not isinstance(s, int) for v in values if isinstance(v, torch.Tensor) for s in v.shape)


def _max_diff(got: Any, expected: Any) -> float:
    worst = 0.0
    for g, e in zip(got, expected):
        if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and e.numel() and g.shape == e.shape:
            d = (g.double() - e.double()).abs()
            d = d[~(g.double().isnan() & e.double().isnan())]
            worst = max(worst, d.max().item() if d.numel() else 0.0)
    return worst


def compare(got: Any, expected: Any) -> tuple[str, str, float]:
    """("pass" or "wrong", why, the largest absolute difference)."""
    g_leaves, e_leaves = pytree.tree_leaves(got), pytree.tree_leaves(expected)
    if len(g_leaves) != len(e_leaves):
        return "wrong", f"{len(g_leaves)} outputs, eager has {len(e_leaves)}", float("nan")
    diff = _max_diff(g_leaves, e_leaves)
    for i, (g, e) in enumerate(zip(g_leaves, e_leaves)):
        try:
            if isinstance(e, torch.Tensor):
                torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL, equal_nan=True)
            elif g != e:
                return "wrong", f"output {i}: {g!r}, eager {e!r}", diff
        except (AssertionError, TypeError) as err:
            first = str(err).strip().splitlines()[0]
            return "wrong", f"output {i}: {first[:120]} (max abs diff {diff:.3g})", diff
    return "pass", "", diff


def _node_op(program: ExportedProgram, name: str) -> str:
    """The op of the node an IREE error names ("" when it names none)."""
    node = next((n for n in program.graph.nodes if n.name == name), None) if name else None
    return op_name(node.target) if node is not None and node.op == "call_function" else ""


def run_on_iree(backend: Any, program: ExportedProgram, module: OpModule, expected: Any) -> dict[str, Any]:
    """Compile `program` on IREE, run it on the sample, compare with `expected`."""
    inputs = module.fresh_inputs()
    start = time.perf_counter()
    try:
        compiled = backend.compile(program, inputs)
    except IreeCompileError as e:
        return {"status": "compile", "why": _short(e, 220), "op": e.op, "node_op": _node_op(program, e.node)}
    except IreeImportError as e:
        return {"status": "import", "why": _short(e, 220), "op": e.op}
    except IreeUnsupportedError as e:
        return {"status": "unsupported", "why": _short(e)}
    except Exception as e:  # the backend's own bug: reported as such
        return {"status": "backend-crash", "why": _short(e)}
    compile_s = time.perf_counter() - start
    try:
        got = compiled(*inputs)
    except Exception as e:
        return {"status": "run", "why": _short(e), "compile_s": compile_s}
    status, why, diff = compare(got, expected)
    return {"status": status, "why": why, "max_diff": diff, "compile_s": compile_s, "cached": compiled.from_cache}


def _export(module: OpModule, variant: str) -> ExportedProgram:
    dynamic = None
    if variant == "dynamic":
        dynamic = (tuple({i: Dim.AUTO for i in range(t.dim())} for t in module.inputs),)
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with warnings.catch_warnings(), quiet[0], quiet[1]:
        warnings.simplefilter("ignore")
        return torch.export.export(module, module.fresh_inputs(), dynamic_shapes=dynamic)


def eager(module: OpModule) -> tuple[str, Any]:
    """("ok", outputs), ("random", None) when two seeds give different outputs, or ("eager-error", why)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            first = module(*module.fresh_inputs())
            torch.manual_seed(1)
            second = module(*module.fresh_inputs())
    except Exception as e:
        return "eager-error", _short(e)
    try:
        torch.testing.assert_close(first, second, rtol=0, atol=0, equal_nan=True)
    except (AssertionError, TypeError):
        return "random", None
    return "ok", first


def check(op: Any, sample: Any, variant: str, backend: Any, rules: Any, *, as_exported: bool = True) -> dict[str, Any]:
    """Everything about one sample in one variant: export, IREE as exported, apply, IREE after the rules."""
    record: dict[str, Any] = {"variant": variant}
    module = OpModule(op.op, sample)
    verdict, expected = eager(module)
    if verdict != "ok":
        record.update(status=verdict, why=expected if verdict == "eager-error" else "eager differs between seeds")
        return record
    try:
        program = _export(module, variant)
    except Exception as e:
        record.update(status="export", why=_short(e))
        return record
    if variant == "dynamic" and not _is_dynamic(program):
        record.update(status="static-only", why="export specialised every dim")
        return record
    seeded = _random_ops(program)
    if seeded:  # IREE's random numbers are not torch's: nothing to compare
        record.update(status="random", why=f"{seeded[0]} draws random numbers")
        return record
    record["status"] = "checked"
    record["ops"] = _graph_ops(program)
    if as_exported:
        record["exported"] = run_on_iree(backend, program, module, expected)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fx_rewrites.apply(program, rules)
    except RewriteError as e:
        record["after"] = {"status": "apply-declined", "why": _short(e, 300)}
        return record
    except Exception as e:
        record["after"] = {"status": "apply-crash", "why": _short(e, 300)}
        return record
    record["apply_s"] = time.perf_counter() - start
    record["rule_s"] = {k: round(v, 6) for k, v in result.report.seconds.items() if v}
    record["fired"] = dict(result.report.rewrites)
    record["ops_after"] = _graph_ops(result.program)
    record["after"] = run_on_iree(backend, result.program, module, expected)
    return record


def iter_checks(
    op: Any, count: int, backend: Any, rules: Any, skip: set[tuple[int, str]] = frozenset()
) -> Iterator[tuple[int, str, Callable[[], dict[str, Any]]]]:
    """(sample index, variant, a thunk that checks it) for the op's samples, `skip` left out."""
    dtype = pick_dtype(op)
    if dtype is None:
        return
    for index, sample in enumerate(samples(op, dtype, count)):
        for variant in VARIANTS:
            if (index, variant) not in skip:
                yield index, variant, lambda s=sample, v=variant: check(op, s, v, backend, rules)
