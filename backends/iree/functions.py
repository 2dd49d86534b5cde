"""Several exported programs as one IREE module: a public function each, one copy of the weights and the state.

    module = backend.compile_module({"prefill": prefill_ep, "decode": decode_ep}, same_state=True)
    module.functions["prefill"](...); module.functions["decode"](...)   # one VM context: the state is shared
    module.save("lm.vmfb", params="lm.irpa"); backend.load_file("lm.vmfb", ("prefill", "decode"))

`IreeBackend.compile_module` is `compile_functions` (import and compile, or the cache) and `loaded` (every
function bound in one VM context): the backend's `ModuleBackend` capability (`backends.base`), which
`compile_lm` and the size dispatch use.

One FxImporter imports every program with one set of hooks (`parameters.parameter_hooks` over all of
them): a weight the programs share (the same tensor object) is one `#stream.parameter.named` global that
each function loads; a buffer they update under the same key is one mutable global (`state.wrap_state`
around each `<name>$body`), so what one function stores the next one reads, inside the module, with no
copy through the host. Each function carries its own call plan in its `iree.reflection`. (iree-turbine's
`FxProgramsBuilder` shares globals between functions the same way, by tensor identity.)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from fx_rewrites.backends.convention import Plan
from fx_rewrites.backends.iree import memory, refusals
from fx_rewrites.backends.iree.artifact import CALL_KEY, UNSUPPORTED_KEY, reflection
from fx_rewrites.backends.iree.assumptions import shape_options
from fx_rewrites.backends.iree.cache import cache_key
from fx_rewrites.backends.iree.cpus import IreeCpuError
from fx_rewrites.backends.iree.encoding import packer
from fx_rewrites.backends.iree.errors import IreeUnsupportedError, import_error
from fx_rewrites.backends.iree.importing import iree_modules, make_importer, set_reflection
from fx_rewrites.backends.iree.parameters import embed_parameters, inline_limit, nbytes, parameter_hooks
from fx_rewrites.backends.iree.preparing import prepare_program
from fx_rewrites.backends.iree.runtime import IreeCompiled, load_functions, save_and_reopen
from fx_rewrites.backends.iree.state import StateGlobals, body_name, lift_state, state_tensor, wrap_state

_STATE_OUT = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)


@attrs.frozen(eq=False)
class IreeFunctions:
    """A compiled module of several functions: `plans` (function -> call plan), the MLIR, the `vmfb`
    bytes, the cache key, and the `parameters` (key -> tensor) every function reads from scope `model`;
    `state`: function -> the keys of the mutable globals it reads and writes."""

    plans: Mapping[str, Plan] = attrs.field(repr=False)
    mlir: str = attrs.field(repr=False)
    vmfb: bytes = attrs.field(repr=False)
    key: str = ""
    from_cache: bool = False
    parameters: Mapping[str, torch.Tensor] = attrs.field(factory=dict, repr=False)
    state: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)


def _holds(program: ExportedProgram, key: str) -> bool:
    return key in program.state_dict or key in program.constants


def _state_keys(state: StateGlobals | None) -> tuple[str, ...]:
    return () if state is None else tuple(sorted(state.tensors))


def import_functions(
    iree: Any,
    programs: Mapping[str, tuple[ExportedProgram, StateGlobals | None]],
    *,
    hooks: Any,
    reflections: Callable[[], Mapping[str, Mapping[str, str]]] | None = None,
) -> str:
    """torch-dialect MLIR of one module with a public function per (name, (prepared program, state)):
    each imported by the same importer and `hooks`, as `name` (no state) or as the private `<name>$body`
    wrapped by `name` (`wrap_state`). `reflections` is asked once every function is imported."""
    ir = iree.compiler.ir
    importer, current = make_importer(iree, hooks)
    public = {}
    for name, (program, state) in programs.items():
        try:
            if state is None:
                public[name] = importer.import_frozen_program(program, func_name=name, **shape_options())
            else:
                body = importer.import_frozen_program(
                    program, func_name=body_name(name), func_visibility="private", **shape_options()
                )
                public[name] = wrap_state(ir, importer, body, state, hooks, name=name)
        except Exception as e:
            raise import_error(e, current[0]) from e
    for name, entries in (reflections() if reflections else {}).items():
        set_reflection(iree, importer, public[name], entries)
    return importer.module.operation.get_asm(enable_debug_info=True)


def compile_functions(
    backend: Any,
    programs: Mapping[str, ExportedProgram],
    *,
    extra: Mapping[str, Mapping[str, str]] | None = None,
    limit: int | None = None,
    same_state: bool = False,
) -> IreeFunctions:
    """`programs` (function name -> ExportedProgram, rules already applied) compiled by `backend` (an
    `IreeBackend`) into one module, or taken from its cache.

    `extra`: more `iree.reflection` entries per function; `limit`: the size in bytes from which a state
    tensor is a parameter (default `inline_limit()`; 0: every weight); `same_state`: every function must read
    and write the same state keys (a KV cache that prefill fills and decode extends), else ValueError.
    """
    if backend.state != "module":
        raise ValueError(
            "several functions share their state only inside the module; use an IreeBackend with state='module'"
        )
    prepared: dict[str, tuple[ExportedProgram, StateGlobals | None]] = {}
    plans: dict[str, Plan] = {}
    for name, program in programs.items():
        if not isinstance(program, ExportedProgram):
            raise TypeError(f"function {name!r}: expected an ExportedProgram, got {type(program).__name__}")
    # a buffer one function writes is state in every function that reads it (else a reader would see the
    # value frozen at compile time, not what the writer stored)
    written = {s.target for p in programs.values() for s in p.graph_signature.output_specs if s.kind in _STATE_OUT}
    for key in sorted(written):
        holders = {n: state_tensor(p, key) for n, p in programs.items() if _holds(p, key)}
        if len({id(t) for t in holders.values()}) > 1:
            raise ValueError(
                f"functions {sorted(holders)} name the state {key!r} with different tensors, so they cannot share "
                "it; export every program from one module instance"
            )
    for name, program in programs.items():
        if backend.refuse_wrong_forms:
            refusals.refuse(program.graph_module)
        copy, plan = prepare_program(program, state=written)
        plans[name], state = lift_state(program, plan)
        prepared[name] = (copy, state)
    keys = {name: _state_keys(state) for name, (_, state) in prepared.items()}
    if same_state and len(set(keys.values())) > 1:
        raise ValueError(
            "the functions do not update the same state, so they cannot share it: "
            + "; ".join(f"{n}: {list(k)}" for n, k in keys.items())
            + ". Export every program from one module instance whose buffers they all update"
        )
    iree = iree_modules()
    hooks = parameter_hooks(
        iree,
        {name: copy for name, (copy, _) in prepared.items()},
        limit=inline_limit() if limit is None else limit,
    )

    needs = backend.cpu_requirement()

    def reflections() -> dict[str, dict[str, str]]:
        out = {}
        for name, plan in plans.items():
            entries = reflection(plan, backend.driver, parameters=bool(hooks.tensors), cpu=needs)
            out[name] = {**entries, **(extra or {}).get(name, {})}
        return out

    mlir = import_functions(iree, prepared, hooks=hooks, reflections=reflections)
    del prepared
    flags = (*backend.flags, *backend.perf_flags_for(mlir))
    key = cache_key(mlir, (backend.target.name, *flags))
    first = next(iter(programs.values())).graph_module
    vmfb, cached = backend.cache.get_or_compile(key, lambda: backend._compile_mlir(iree, mlir, first))
    return IreeFunctions(plans, mlir, vmfb, key, cached, dict(hooks.tensors), keys)


def embedded(backend: Any, functions: IreeFunctions, graph_module: Any = None) -> bytes:
    """`functions`' module compiled again by `backend` with its parameters inline, each function's call
    convention saying it reads none: a self-contained .vmfb (a save without `params=`). `graph_module`
    names nodes in a compile error."""
    weights = sum(nbytes(t) for t in functions.parameters.values())
    memory.check(
        "iree-compile",
        f"a self-contained .vmfb with {weights / 1e6:.0f} MB of weights inside",
        memory.compile_estimate(weights),
        "save the weights beside it: save('model.vmfb', params='model.irpa')",
    )
    iree = iree_modules()
    context = iree.compiler.ir.Context()
    mlir = functions.mlir
    needs = backend.cpu_requirement()
    for plan in functions.plans.values():  # one replacement each: equal conventions are replaced in turn
        before = reflection(plan, backend.driver, parameters=True, cpu=needs)
        if CALL_KEY in before:
            after = reflection(plan, backend.driver, parameters=False, cpu=needs)
            old, new = (str(iree.compiler.ir.StringAttr.get(e[CALL_KEY], context=context)) for e in (before, after))
            mlir = mlir.replace(old, new, 1)
    return backend._compile_mlir(iree, embed_parameters(mlir, functions.parameters), graph_module)


@attrs.define(eq=False)
class IreeModule:
    """One IREE module of several functions, compiled or loaded from a file (`backends.base.Module`).

    `functions`: name -> `IreeCompiled`, all bound in one VM context (they share the module's globals);
    `vmfb` the compiled bytes and `mlir` the imported text ("" once loaded); `parameters` the weights it reads
    (key -> tensor; None once loaded: then `archive` is the .irpa it reads them from); `embed` compiles it
    again with its parameters inside (a save without `params=`); `unsupported` why it cannot be saved."""

    functions: dict[str, IreeCompiled]
    vmfb: bytes = attrs.field(repr=False)
    mlir: str = attrs.field(default="", repr=False)
    parameters: Mapping[str, torch.Tensor] | None = attrs.field(default=None, repr=False)
    archive: Path | None = None
    embed: Callable[[], bytes] | None = attrs.field(default=None, repr=False)
    unsupported: str = ""
    #: writes the parameters packed as the module reads them and returns that module (`encoding.pack`)
    pack: Callable[[Path, Mapping[str, torch.Tensor]], bytes | None] | None = attrs.field(default=None, repr=False)

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        params: str | os.PathLike[str] | None = None,
        records: Mapping[str, str] | None = None,
    ) -> None:
        """Write the module to `path` (.vmfb) and, with `params`, its weights to that .irpa (else inside it); a
        module of no state then reads them from that archive, as `IreeCompiled.save` says. `records`: short
        texts written into the archive, not into the module (`artifact.save`; read back by the backend's
        `read_record`)."""
        save_and_reopen(self, self.functions, path, params, records)  # this module then reads the saved archive


def loaded(
    backend: Any, functions: IreeFunctions, graph_module: Any = None, *, state_restarts: bool = False
) -> IreeModule:
    """`functions` loaded on `backend`'s device: an `IreeCompiled` per function, in one VM context.
    `graph_module` names nodes in the errors of a later self-contained compile (`embedded`). Code for a CPU
    this host cannot run is not loaded: it saves, and a call raises `cpus.IreeCpuError`. A `save(params=)`
    moves the module onto the archive it wrote (`runtime.reopen`) where it keeps no state, or where
    `state_restarts` says its state may start over (`compile_lm`: every generate fills the KV cache it reads)."""
    refused = None
    try:
        bound = backend.load_module(functions.vmfb, functions.parameters)
    except IreeCpuError as e:  # built for another CPU (`IreeBackend.for_cpu`): saved, it runs there
        bound, refused = dict.fromkeys(functions.plans), e
    calls = {}
    # a new context starts the state over: only where it keeps none, or where that is allowed
    movable = state_restarts or not any(functions.state.values())
    for name, plan in functions.plans.items():
        why = reflection(plan, backend.driver).get(UNSUPPORTED_KEY, "")
        calls[name] = IreeCompiled(
            plan,
            bound[name],
            functions.mlir,
            functions.vmfb,
            functions.key,
            functions.from_cache,
            why,
            parameters=functions.parameters,
            refused=refused,
            reopen=backend.load_module if movable else None,
        )
    embed = functools.partial(embedded, backend, functions, graph_module) if functions.parameters else None
    unsupported = next((c.unsupported for c in calls.values() if c.unsupported), "")
    pack = packer(backend, functions.mlir, functions.parameters, graph_module, functions=len(functions.plans))
    return IreeModule(calls, functions.vmfb, functions.mlir, functions.parameters, None, embed, unsupported, pack)


def from_file(
    path: str | os.PathLike[str], names: tuple[str, ...], *, params: Any = None, driver: str | None = None
) -> IreeModule:
    """The module a `save` wrote to `path`, with functions `names` (`runtime.load_functions`)."""
    calls = load_functions(path, names, params=params, driver=driver)
    first = next(iter(calls.values()))
    return IreeModule(calls, first.vmfb, archive=first.archive)


__all__ = [
    "IreeFunctions",
    "IreeModule",
    "IreeUnsupportedError",
    "compile_functions",
    "embedded",
    "from_file",
    "import_functions",
    "loaded",
]
