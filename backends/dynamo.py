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
"""

from __future__ import annotations

import atexit
import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
from torch.fx import GraphModule

from fx_rewrites import backends
from fx_rewrites.api import Result, apply
from fx_rewrites.backends.base import Backend
from fx_rewrites.ruleset import RuleSet

#: what `dynamo_backend` names its backends: fx_rewrites_<backend name, "-" as "_">
PREFIX = "fx_rewrites_"

log = logging.getLogger(__name__)

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


@attrs.frozen
class CompiledGraph:
    """One graph of a torch.compile'd function, as the `on_graph` hook sees it.

    `kind` is "inference" (traced under no_grad, or nothing needs grad) or
    "forward" (the forward of a training graph); `graph_module` the graph
    aot_autograd gave, `result` what `fx_rewrites.apply` made of it
    (`result.report.rewrites`: rule name -> count), `compiled` what the
    backend returned for it.
    """

    backend: str
    kind: Literal["inference", "forward"]
    graph_module: GraphModule
    example_inputs: Sequence[Any]
    result: Result
    compiled: Callable[..., Any]


def _compile_graph(
    backend: Backend | str,
    rules: RuleSet | None,
    on_graph: Callable[[CompiledGraph], None] | None,
    kind: Literal["inference", "forward"],
    gm: GraphModule,
    example_inputs: Sequence[Any],
) -> Callable[[list[Any]], Any]:
    from functorch.compile import make_boxed_func

    target = backends.get(backend) if isinstance(backend, str) else backend
    result = apply(gm, target.rules if rules is None else rules)
    log.debug("%s graph for %s: %s", kind, target.name, result.report.summary())
    result.report.warn_unless_converged(target.name, stacklevel=2)
    compiled = target.compile(result.graph_module, example_inputs)
    if callable(getattr(compiled, "release", None)):
        _LIVE.add(compiled)
    if on_graph is not None:
        on_graph(CompiledGraph(target.name, kind, gm, example_inputs, result, compiled))
    return make_boxed_func(compiled)


def _backward(name: str, mode: Literal["eager", "error"], gm: GraphModule, example_inputs: Sequence[Any]) -> Any:
    from functorch.compile import make_boxed_func

    what = (
        f"torch.compile(backend={name}) compiles inference and forward graphs only: "
        "run the compiled model under torch.no_grad() (or torch.inference_mode()) for inference"
    )
    if mode == "error":

        def refuse(*args: Any) -> Any:
            raise BackwardNotSupported(
                f"{what}; a backward was requested, and this backend was made with backward='error'. "
                "Use backward='eager' to run backward graphs on torch eager."
            )

        return make_boxed_func(refuse)
    warned = False

    def run(*args: Any) -> Any:
        nonlocal warned
        if not warned:
            warned = True
            warnings.warn(f"{what}; this backward graph runs on torch eager.", stacklevel=2)
        return gm(*args)

    return make_boxed_func(run)


def dynamo_backend(
    backend: str | Backend,
    *,
    rules: RuleSet | None = None,
    on_graph: Callable[[CompiledGraph], None] | None = None,
    backward: Literal["eager", "error"] = "eager",
) -> Callable[[GraphModule, Sequence[Any]], Callable[..., Any]]:
    """A `torch.compile(backend=...)` callable for the fx-rewrites backend `backend`.

    `backend` is a registered name (looked up at the first compile, so
    entry-point backends work) or a Backend; `rules` replaces the backend's
    RuleSet; `on_graph` is called with a `CompiledGraph` for every graph
    compiled (for tests, logging, saving graphs); `backward` says what
    happens when a backward runs (see the module docstring).
    """
    if backward not in ("eager", "error"):
        raise ValueError(f"backward must be 'eager' or 'error', got {backward!r}")
    from torch._dynamo.backends.common import aot_autograd

    # a Python name, as torch.compile(backend="fx_rewrites_iree_cuda") finds it: "-" becomes "_"
    name = f"{PREFIX}{backend if isinstance(backend, str) else backend.name}".replace("-", "_")
    compile_graph = functools.partial(_compile_graph, backend, rules, on_graph)
    aot = aot_autograd(
        fw_compiler=functools.partial(compile_graph, "forward"),
        inference_compiler=functools.partial(compile_graph, "inference"),
        bw_compiler=functools.partial(_backward, name, backward),
    )

    def compiler(gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
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
    "BackwardNotSupported",
    "CompiledGraph",
    "dynamo_backend",
    "fx_rewrites_eager",
    "fx_rewrites_iree",
    "fx_rewrites_iree_cuda",
    "fx_rewrites_iree_rocm",
    "fx_rewrites_iree_vulkan",
]
