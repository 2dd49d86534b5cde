"""`fx_rewrites.compile` and `fx_rewrites.load`: a model to a callable (and a file) in one call.

    compiled = fx_rewrites.compile(model, (x,), {"use_cache": False})   # export, the backend's rules, compile
    compiled(x)                                                           # called like the model
    compiled.save("model.vmfb")                  # iree-run-module runs it; params="model.irpa" keeps weights apart
    fx_rewrites.load("model.vmfb")(x)            # the call convention comes back with it; no pickle
    compiled.save("any_avx2.vmfb", cpu="x86-64-v3")   # for another CPU (also: compile(..., cpu="aarch64"))

It sits above the backends: export (torch.export), `fx_rewrites.apply(program,
backend.rules)`, then `backend.compile(program, args)`, which never rewrites.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram

from fx_rewrites.engine import Report, RewriteError
from fx_rewrites.program import quiet_torch_pytree


class ExportFailed(RewriteError):
    """torch.export could not export the model; the message says why and what to change."""


def export_hint(e: BaseException, instead: str = "pass the ExportedProgram") -> str:
    """What to do about a torch.export failure, from its type and text (`instead`: the way around export)."""
    text = str(e)
    if "DynamicCache" in text or "Cache" in type(e).__name__:
        return (
            "a transformers cache object (DynamicCache) is among the outputs, and torch.export cannot return it; "
            "pass use_cache=False in kwargs (fx_rewrites.compile(model, args, {'use_cache': False})), or return "
            "the cache as tensors"
        )
    if "data-dependent" in text or type(e).__name__ == "GuardOnDataDependentSymNode":
        return (
            "Python control flow on a tensor's value (`if x.sum() > 0:`) cannot be exported. Write the branch "
            "as torch.cond(pred, true_fn, false_fn, (x,)) (fx-rewrites' cond rules then lower it for the "
            "backend) or as torch.where(pred, a, b)"
        )
    if "Constraints violated" in text or "specialized" in text:
        return "follow the fix torch suggests below (the example inputs fix a size the model treats as dynamic)"
    return (
        "make `torch.export.export(module, example_args)` work on the model first (torch.export.draft_export "
        f"lists every problem at once), or export it yourself and {instead}"
    )


@attrs.define(eq=False)
class Compiled:
    """A compiled model: call it as the model was called (args and kwargs).

    `program` is the rewritten ExportedProgram, `report` what the rules did,
    `runtime` the backend's callable (an `IreeCompiled` for IREE). Keyword
    arguments that were non-tensor constants when it was compiled
    (`use_cache=False`) may be left out.
    """

    backend: str
    program: ExportedProgram = attrs.field(repr=False)
    report: Report = attrs.field(repr=False)
    runtime: Any = attrs.field(repr=False)
    #: the CPU the code is built for ("host", "x86-64-v3", ...; `backends.base.CpuTargets`), None where the
    #: backend builds for no CPU by name (a GPU, eager)
    cpu: str | None = None
    #: the same compile for another CPU: cpu -> Compiled (`save(cpu=)`)
    retarget: Callable[[str], Compiled] | None = attrs.field(default=None, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runtime(*args, **kwargs)

    def save(
        self, path: str | os.PathLike[str], *, params: str | os.PathLike[str] | None = None, cpu: str | None = None
    ) -> None:
        """Write the compiled module (IREE: a .vmfb `iree-run-module` runs; with `params`, the module as
        compiled and its weights of 64 KiB or more (float8 and bfloat16 ones whatever their size) in that IREE
        parameter archive, .irpa, the way for large models; without, one self-contained file, compiled once
        more with the weights inside; float8 weights cannot be inside).
        `fx_rewrites.load(path)` reads it back. `cpu`: write code for that CPU ("x86-64-v3": any AVX2
        machine; "aarch64"; docs/deploy.md), compiled again from the program for it when it is not the one
        compiled for; the file records the CPU and the features it needs."""
        from fx_rewrites.backends.base import ArtifactError, save_for_cpu

        if save_for_cpu(self, path, params=params, cpu=cpu):
            return
        save = getattr(self.runtime, "save", None)
        if save is None:
            raise ArtifactError(
                f"the {self.backend} backend writes no artifact. Fix: compile with backend='iree' to save a .vmfb, "
                "or save the rewritten program with torch.export.save(compiled.program, 'model.pt2')."
            )
        save(path, params=params)


def _export(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None, dynamic_shapes: Any
) -> ExportedProgram:
    try:
        return torch.export.export(model, args, kwargs or None, dynamic_shapes=dynamic_shapes)
    except Exception as e:
        raise ExportFailed(
            f"torch.export could not export {type(model).__name__}: {type(e).__name__}: "
            f"{' '.join(str(e).split())[:600]}. Fix: {export_hint(e)}."
        ) from e


def compile(
    model: torch.nn.Module | ExportedProgram,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    backend: str | Any = "iree",
    dynamic_shapes: Any = None,
    cpu: str | None = None,
) -> Compiled:
    """Export `model` with `args`/`kwargs` (an ExportedProgram is taken as is), apply the backend's
    rules (`fx_rewrites.apply(program, backend.rules)`) and compile. `backend` is a registered name
    or a Backend; `dynamic_shapes` goes to torch.export (e.g. `{"x": {0: torch.export.Dim("batch")}}`).
    `cpu`: the CPU to build for (`backend='iree'`: "host", the default, "x86-64-v3" for any AVX2 machine,
    "x86-64-v4" for AVX-512, "aarch64"); code this machine cannot run is compiled, not loaded: it saves,
    and a call says why it cannot run here (`BackendUnavailable`).

    A `torch.cond` on the input sizes (`x.shape[1] <= 512` with a Dim) is compiled side by side and each call
    runs the side its sizes pick (`fx_rewrites.app.dispatch`); `.program` computes both and selects."""
    from fx_rewrites import backends
    from fx_rewrites.api import apply
    from fx_rewrites.app.dispatch import compile_dispatch, size_conds
    from fx_rewrites.app.distributed import export_local, is_tensor_parallel
    from fx_rewrites.backends.base import for_cpu
    from fx_rewrites.backends.collectives import has_collectives
    from fx_rewrites.program import unwrap_tensor_subclasses, with_own_state

    chosen = backends.get(backend) if isinstance(backend, str) else backend
    target = for_cpu(chosen, cpu)
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple):
        raise TypeError(
            f"args is a {type(args).__name__}; it is the tuple of the model's positional inputs: "
            "fx_rewrites.compile(model, (x,)) for one input"
        )
    with quiet_torch_pytree():
        if isinstance(model, ExportedProgram):
            if dynamic_shapes is not None:
                raise TypeError(
                    "dynamic_shapes= applies when fx_rewrites.compile exports a module; an ExportedProgram "
                    "already carries its shapes (pass them to torch.export.export instead)"
                )
            program = model
        elif isinstance(model, torch.nn.Module) and is_tensor_parallel(model):
            program = export_local(model, args, kwargs, dynamic_shapes)  # this rank's shards and collectives
        elif isinstance(model, torch.nn.Module):
            program = _export(model, args, dict(kwargs) if kwargs else None, dynamic_shapes)
        else:
            raise TypeError(
                f"fx_rewrites.compile takes a torch.nn.Module (a GraphModule is one) or a "
                f"torch.export.ExportedProgram, got {type(model).__name__}"
            )
        program = unwrap_tensor_subclasses(program)  # torchao's quantized weights (the cond path reads it too)
        result = apply(program, target.rules)
        result.report.warn_unless_converged(target.name)
        dispatched = size_conds(program)
        if has_collectives(result.program):  # a rank's program: segments on the backend, collectives on the host
            runtime = _compile_rank(target, with_own_state(result.program))
        elif len(dispatched) == 1:  # a cond on the sizes: each side compiled, the call's sizes pick one
            runtime = compile_dispatch(with_own_state(program), dispatched[0], target, args)
        else:
            runtime = target.compile(with_own_state(result.program), args)  # its own buffers, not .program's
    retarget = None
    if isinstance(target, backends.CpuTargets):
        retarget = functools.partial(_retarget, program, args, kwargs, chosen)
    return Compiled(target.name, result.program, result.report, runtime, getattr(target, "cpu", None), retarget)


def _retarget(program: ExportedProgram, args: Any, kwargs: Any, backend: Any, cpu: str) -> Compiled:
    return compile(program, args, kwargs, backend=backend, cpu=cpu)


def _compile_rank(target: Any, program: ExportedProgram) -> Any:
    """A rank's program (functional collectives between local compute) as one module of segments."""
    from fx_rewrites import backends
    from fx_rewrites.app.distributed import compile_segmented

    if not isinstance(target, backends.ModuleBackend):
        raise ValueError(
            f"this program holds torch.distributed collectives (a rank of a tensor-parallel model): it is compiled as "
            f"the segments between them, functions of one module, and backend {target.name!r} cannot build such a "
            "module (backends.ModuleBackend). Fix: backend='iree', or torch.compile(model, backend=...), which "
            "compiles each segment on its own"
        )
    return compile_segmented(target, {"main": program})


def load(
    path: str | os.PathLike[str],
    *,
    params: str | os.PathLike[str] | None = None,
    driver: str | None = None,
    backend: str | Any = "iree",
):
    """A compiled module saved with `compiled.save(path)`, called like the model it came from.

    Only the call convention (JSON inside the .vmfb) and IREE's module are
    read: no pickle, no Python from the file. `params` is the parameter
    archive it was saved with (default: PATH with the suffix .irpa);
    `driver` overrides the IREE driver it was compiled for ("local-task"). A module from
    `fx_rewrites.compile_lm` comes back as a `CompiledLM` (`generate`), one of a size dispatch as a
    `SizeDispatch` (the guard is data in its metadata, evaluated on each call's sizes). `backend`: the
    backend that reads the file (`backends.base.ModuleBackend`)."""
    from fx_rewrites import backends
    from fx_rewrites.app.dispatch import is_dispatch, load_dispatch
    from fx_rewrites.app.distributed import find_tp, load_segmented
    from fx_rewrites.app.lm import has_lm, is_lm, load_lm

    target = backends.get(backend) if isinstance(backend, str) else backend
    path = Path(path)
    metadata = target.read_metadata(path) if path.is_file() else {}
    if find_tp(metadata) is not None:  # a rank's module of a tensor-parallel model
        module = load_segmented(path, metadata, target, params=params, driver=driver)
        return load_lm(path, module=module, metadata=metadata) if has_lm(metadata) else module
    if is_lm(metadata):  # fx_rewrites.compile_lm's: prefill and decode
        return load_lm(path, params=params, driver=driver, backend=target)
    if is_dispatch(metadata):  # a size dispatch's: when_true and when_false, the guard as data
        return load_dispatch(path, params=params, driver=driver, backend=target)
    return target.load_file(path, ("main",), params=params, driver=driver).functions["main"]


def flat_inputs(compiled: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> list[Any]:
    """The tensors the compiled function takes, in order, for a call with `args`/`kwargs`."""
    from fx_rewrites.backends.convention import bind

    runtime = getattr(compiled, "runtime", compiled)
    flat = bind(runtime.plan, tuple(args), dict(kwargs or {}))
    return [flat[i] if isinstance(i, int) else i for i in runtime.plan.args]


__all__ = ["Compiled", "ExportFailed", "compile", "export_hint", "flat_inputs", "load"]
