"""torch.compile glue: every fx-rewrites backend as a dynamo backend.

    compiled = torch.compile(model, backend=backends.dynamo.fx_rewrites_iree)
    # or backend="fx_rewrites_iree" once the torch_dynamo_backends entry point is installed
    with torch.no_grad():
        compiled(x)

Dynamo cuts the function into graphs at graph breaks; the Python between
them (tokenizers, post-processing, `.tolist()`, prints) runs in Python.
aot_autograd turns each graph into a functional ATen forward graph (the
"R3" form of docs/torch-2.13-graph-forms.md), and the forward compiler here
runs `fx_rewrites.apply(graph, backend.rules)` and `backend.compile`s the
result.

Inference is what runs on the backend. A graph traced with grad enabled and
parameters that require grad (the default outside `torch.no_grad()`) is
split by aot_autograd into a forward, which runs on the backend too (it
returns the activations the backward saves), and a backward graph, which
runs on torch eager: `backward="eager"` (the default) warns once per graph
when a backward is first run; `backward="error"` raises
`BackwardNotSupported` instead.

Inference graphs are frozen (`backends/freezing.py`): the parameters and
buffers dynamo lifts into graph inputs are compiled in as constants, as
Inductor's freezing does, so IREE can pack convolution and matmul weights
at compile time; the compiled callable no longer takes them. The graph is
frozen before the rules run, so they see the weights as the graph's own
(get_attr) as the export route's rules see a program's state, and take the
forms that need a weight the program holds (the IREE backend's float32 and
convolution dispatches). Buffers the
graph mutates stay inputs, training graphs are never frozen, and a frozen
weight that changes later (in place or reassigned) makes the next call
warn and compile the graph again. Off: `FX_REWRITES_FREEZE=0`,
`dynamo_backend(..., freeze=False)` or
`torch.compile(..., options={"freeze": False})`.

A graph (inference or forward) the rules or the backend cannot take runs on
torch eager, as aot_autograd gave it, with one `EagerFallbackWarning` per
graph that names the op and the error; the other graphs still run on the
backend. Strict mode raises instead (the error as the backend gave it,
wrapped by dynamo in `BackendCompilerFailed`): `FX_REWRITES_STRICT=1`,
`dynamo_backend(..., strict=True)` or
`torch.compile(..., options={"strict": True})`.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
from torch.fx import GraphModule

from fx_rewrites import backends
from fx_rewrites.api import Result, apply
from fx_rewrites.backends import collectives, freezing, segments
from fx_rewrites.backends.base import Backend
from fx_rewrites.ruleset import RuleSet

#: what `dynamo_backend` names its backends: fx_rewrites_<backend name, "-" as "_">
PREFIX = "fx_rewrites_"

log = logging.getLogger(__name__)

#: "1": a graph the backend cannot compile raises instead of running on torch eager
STRICT_ENV = "FX_REWRITES_STRICT"

#: compiled graphs with runtime objects to free before the interpreter shuts down (see `_release_at_exit`)
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """Release the compiled graphs dynamo's caches still hold (a graph break keeps them alive to the end).

    Left to interpreter shutdown, IREE's runtime objects outlive their nanobind module, which then prints
    ~100 lines of `nanobind: leaked ...`."""
    for compiled in list(_LIVE):
        compiled.release()


class BackwardNotSupported(RuntimeError):
    """A backward ran through a graph compiled with `dynamo_backend(..., backward="error")`."""


class EagerFallbackWarning(UserWarning):
    """A graph the backend could not compile runs on torch eager (`-W error::...EagerFallbackWarning`, or
    strict mode, makes it an error)."""


def strict_enabled(option: bool | None) -> bool:
    """Whether a graph the backend cannot compile raises: `option`, else `$FX_REWRITES_STRICT` not "" or "0"."""
    if option is not None:
        return bool(option)
    return os.environ.get(STRICT_ENV, "0").strip() not in ("", "0")


def _failing_op(error: BaseException) -> str:
    """The op an error names: the backend's `.op` (IreeCompileError, IreeImportError), else one in `op`-quotes."""
    op = getattr(error, "op", "") or ""
    if op:
        return str(op)
    found = re.search(r"`((?:aten|prims|torch|higher_order)\.[\w.]+)`", str(error))
    return found.group(1) if found else ""


def fallback_message(name: str, kind: str, gm: GraphModule, error: BaseException) -> str:
    """The warning of a graph that runs on torch eager because `error` stopped its compile."""
    op = _failing_op(error)
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    if len(first) > 600:
        first = first[:600] + " ..."
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    what = f"`{op}`" if op else "an op (the error does not name it)"
    return (
        f"torch.compile(backend={name}): this {kind} graph ({calls} ops) runs on torch eager, because "
        f"{what} stopped its compile: {type(error).__name__}: {first} "
        f"The other graphs still run on the backend. To run this one there too: a rule that rewrites {what} into "
        f"ops the backend takes (a missing rule is a bug worth reporting, with this message). To raise instead of "
        f"falling back: {STRICT_ENV}=1, or torch.compile(..., options={{'strict': True}})."
    )


@attrs.frozen
class CompiledGraph:
    """One graph of a torch.compile'd function, as the `on_graph` hook sees it.

    `kind` is "inference" (traced under no_grad, or nothing needs grad) or
    "forward" (the forward of a training graph); `graph_module` the graph
    aot_autograd gave, `result` what `fx_rewrites.apply` made of it
    (`result.report.rewrites`: rule name -> count), `compiled` what the
    backend returned for it (for a frozen graph: for the graph with the
    `frozen` inputs as constants, at its first compile), `frozen` the
    dynamo sources of the inputs compiled in as constants, `fallback` the
    warning of a graph that runs on torch eager (then `compiled` is
    `graph_module`, and `result` None when the rules themselves failed).
    """

    backend: str
    kind: Literal["inference", "forward"]
    graph_module: GraphModule
    example_inputs: Sequence[Any]
    result: Result | None
    compiled: Callable[..., Any]
    #: the dynamo sources of the inputs compiled in as constants (`backends/freezing.py`); () when not frozen
    frozen: tuple[str, ...] = ()
    #: the warning of a graph that runs on torch eager; "" when the backend compiled it
    fallback: str = ""


def _compile_graph(
    backend: Backend | str,
    rules: RuleSet | None,
    on_graph: Callable[[CompiledGraph], None] | None,
    name: str,
    strict: bool,
    state: dict[int, tuple[str, Any]],
    kind: Literal["inference", "forward"],
    gm: GraphModule,
    example_inputs: Sequence[Any],
) -> Callable[[list[Any]], Any]:
    from functorch.compile import make_boxed_func

    target = backends.get(backend) if isinstance(backend, str) else backend
    result: Result | None = None
    try:
        split = collectives.has_collectives(gm)
        if split:  # a rank's graph: names the collective the host steps do not run, before any work
            collectives.check(gm)
        frozen = freezing.plan(gm, state) if kind == "inference" else {}
        ruleset = target.rules if rules is None else rules

        def rewritten(graph: GraphModule) -> GraphModule:
            nonlocal result
            result = apply(graph, ruleset)
            log.debug("%s graph for %s: %s", kind, target.name, result.report.summary())
            result.report.warn_unless_converged(target.name, stacklevel=2)
            return result.graph_module

        def rewritten_frozen(graph: GraphModule) -> GraphModule:
            out, count = rewritten(graph), len(graph.graph.find_nodes(op="placeholder"))
            if len(out.graph.find_nodes(op="placeholder")) != count:  # the frozen call passes the inputs it kept
                raise RuntimeError(
                    f"the rules changed the number of inputs of the frozen {kind} graph ({count}): a rule that adds "
                    "or drops a graph input is a bug worth reporting; FX_REWRITES_FREEZE=0 compiles it unfrozen"
                )
            return out

        def build(graph: GraphModule, inputs: Sequence[Any]) -> Any:
            if split:  # the segments between collectives on the backend, the collectives on torch.distributed
                return segments.compile_graph(graph, target.compile)
            return target.compile(graph, inputs)

        if frozen:
            # frozen first, then the rules: they see the weights as the graph's own (get_attr), as the export
            # route's see its state, and take the forms that need a weight the program holds (the float32 and
            # convolution dispatches); a recompile (a frozen weight changed) rewrites the graph again
            kept = [x for i, x in enumerate(example_inputs) if i not in frozen]
            run: Any = freezing.Frozen.make(gm, frozen, lambda g: build(g, kept), rewrite=rewritten_frozen)
            compiled, names = run.compiled, run.names
            log.debug("%s graph for %s: %d inputs frozen", kind, target.name, len(names))
        else:
            run = compiled = build(rewritten(gm), example_inputs)
            names = ()
    except Exception as e:
        if strict:
            raise
        # the graph as aot_autograd gave it: what the rules made of it may hold ops only the backend runs
        message = fallback_message(name, kind, gm, e)
        log.info("%s", message, exc_info=True)
        warnings.warn(message, EagerFallbackWarning, stacklevel=2)
        if on_graph is not None:
            on_graph(CompiledGraph(target.name, kind, gm, example_inputs, result, gm, (), message))
        return make_boxed_func(gm)
    if callable(getattr(run, "release", None)):
        _LIVE.add(run)
    if on_graph is not None:
        on_graph(CompiledGraph(target.name, kind, gm, example_inputs, result, compiled, names))
    return make_boxed_func(run)


def _backward(name: str, mode: Literal["eager", "error"], gm: GraphModule, example_inputs: Sequence[Any]) -> Any:
    from functorch.compile import make_boxed_func

    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    ops = ", ".join(dict.fromkeys(getattr(n.target, "__name__", str(n.target)) for n in calls[:40]))
    what = (
        f"torch.compile(backend={name}) compiles inference and forward graphs only: a backward ran (a "
        "`.backward()` or `torch.autograd.grad` through a graph compiled with grad enabled)"
    )
    listed = f"{len(calls)} ops: {ops[:200]}{' ...' if len(ops) > 200 else ''}"
    if mode == "error":

        def refuse(*args: Any) -> Any:
            raise BackwardNotSupported(
                f"{what}, and this backward graph ({listed}) was refused: this backend was made with "
                "backward='error'. For inference, run the compiled model under torch.no_grad() (or "
                "torch.inference_mode()): no backward graph is made. For training, make the backend with "
                "backward='eager' (the default): the backward graphs then run on torch eager."
            )

        return make_boxed_func(refuse)
    warned = False

    def run(*args: Any) -> Any:
        nonlocal warned
        if not warned:
            warned = True
            warnings.warn(
                f"{what}, and this backward graph runs on torch eager ({listed}); its forward graph stays on the "
                "backend, and the gradients are torch's. For inference, run the compiled model under "
                "torch.no_grad() (or torch.inference_mode()): no backward graph is made and every graph runs on the "
                "backend. For "
                "training this is expected (warned once per backward graph): silence it with "
                "warnings.filterwarnings('ignore', 'compiles inference and forward graphs only'); to raise "
                "instead, make the backend with dynamo_backend(..., backward='error').",
                stacklevel=2,
            )
        return gm(*args)

    return make_boxed_func(run)


def dynamo_backend(
    backend: str | Backend,
    *,
    rules: RuleSet | None = None,
    on_graph: Callable[[CompiledGraph], None] | None = None,
    backward: Literal["eager", "error"] = "eager",
    freeze: bool | None = None,
    strict: bool | None = None,
) -> Callable[..., Callable[..., Any]]:
    """A `torch.compile(backend=...)` callable for the fx-rewrites backend `backend`.

    `backend` is a registered name (looked up at the first compile, so
    entry-point backends work) or a Backend; `rules` replaces the backend's
    RuleSet; `on_graph` is called with a `CompiledGraph` for every graph
    compiled (for tests, logging, saving graphs); `backward` says what
    happens when a backward runs (see the module docstring); `freeze`
    whether inference graphs get their parameters and buffers as constants
    (None: unless `$FX_REWRITES_FREEZE` is "0"; `torch.compile(...,
    options={"freeze": ...})` overrides both); `strict` whether a graph the
    backend cannot compile raises instead of running on torch eager with an
    `EagerFallbackWarning` (None: when `$FX_REWRITES_STRICT` is set and not
    "0"; `options={"strict": ...}` overrides both).
    """
    if backward not in ("eager", "error"):
        raise ValueError(f"backward must be 'eager' or 'error', got {backward!r}")
    from torch._dynamo.backends.common import aot_autograd

    # a Python name, as torch.compile(backend="fx_rewrites_iree_cuda") finds it: "-" becomes "_"
    name = f"{PREFIX}{backend if isinstance(backend, str) else backend.name}".replace("-", "_")
    compile_graph = functools.partial(_compile_graph, backend, rules, on_graph, name)
    bw_compiler = functools.partial(_backward, name, backward)

    def compiler(
        gm: GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None
    ) -> Callable[..., Any]:
        unknown = sorted(set(options or {}) - {"freeze", "strict"})
        if unknown:
            raise ValueError(
                f"torch.compile(backend={name}) takes options {{'freeze': bool, 'strict': bool}}, got {unknown}"
            )
        on = freezing.enabled((options or {}).get("freeze", freeze))
        raises = strict_enabled((options or {}).get("strict", strict))
        # the real tensors of the module state among the inputs; the inference compiler freezes them
        state = freezing.freezable(gm, example_inputs) if on else {}
        aot = aot_autograd(
            fw_compiler=functools.partial(compile_graph, raises, {}, "forward"),
            inference_compiler=functools.partial(compile_graph, raises, state, "inference"),
            bw_compiler=bw_compiler,
        )
        return aot(gm, example_inputs)

    compiler.__name__ = compiler.__qualname__ = name
    compiler.__doc__ = f"torch.compile backend: aot_autograd graphs, rewritten and compiled by {backend!r}."
    return compiler


#: torch.compile(model, backend=fx_rewrites_iree): graphs rewritten with the IREE rules, compiled by IREE
fx_rewrites_iree = dynamo_backend("iree")
#: torch.compile(model, backend=fx_rewrites_eager): graphs rewritten with DEFAULT, run by torch (the reference)
fx_rewrites_eager = dynamo_backend("eager")
#: the same for IREE's GPU targets (backends iree-cuda, iree-rocm, iree-vulkan): compiled for the GPU, run there
fx_rewrites_iree_cuda = dynamo_backend("iree-cuda")
fx_rewrites_iree_rocm = dynamo_backend("iree-rocm")
fx_rewrites_iree_vulkan = dynamo_backend("iree-vulkan")

__all__ = [
    "PREFIX",
    "STRICT_ENV",
    "BackwardNotSupported",
    "CompiledGraph",
    "EagerFallbackWarning",
    "dynamo_backend",
    "fx_rewrites_eager",
    "fx_rewrites_iree",
    "fx_rewrites_iree_cuda",
    "fx_rewrites_iree_rocm",
    "fx_rewrites_iree_vulkan",
    "strict_enabled",
]
