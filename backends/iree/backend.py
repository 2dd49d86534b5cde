"""`IreeBackend`: import, compile (or take from the cache) and load, for one IREE target.

cpu = IreeBackend()                                   # llvm-cpu for this host, local-task
avx2 = cpu.for_cpu("x86-64-v3")                        # code any AVX2 machine runs (`cpus.CPUS`)
gpu = IreeBackend(name="iree-cuda", target=TARGETS["cuda"], device="cuda://0")
artifact = gpu.artifact(program)                       # compile only: no GPU needed
fn = gpu.compile(program, args)                        # compile and load on the device
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx_rewrites.backends.iree import memory, refusals
from fx_rewrites.backends.iree.artifact import CALL_KEY, UNSUPPORTED_KEY, read_record, reflection
from fx_rewrites.backends.iree.cache import CompileCache, cache_key
from fx_rewrites.backends.iree.cpus import CPUS, IreeCpuError, flags_for, requirement, why_not_here
from fx_rewrites.backends.iree.encoding import packer
from fx_rewrites.backends.iree.errors import IreeCompileError, IreeDeviceError, IreeUnsupportedError, compile_error
from fx_rewrites.backends.iree.functions import IreeModule, compile_functions, from_file, loaded
from fx_rewrites.backends.iree.importing import import_mlir, iree_modules
from fx_rewrites.backends.iree.invoke import IreeCompilerFailed, IreeCompileTimeout, default_timeout, run_iree_compile
from fx_rewrites.backends.iree.kernels import spliced
from fx_rewrites.backends.iree.parameters import (
    INLINE_ENV,
    attribute_hooks,
    attribute_tensors,
    embed_parameters,
    inline_limit,
    is_parameter,
    load_parameters,
    memory_parameters,
    nbytes,
    parameter_hooks,
)
from fx_rewrites.backends.iree.preparing import prepare_graph_module, prepare_program
from fx_rewrites.backends.iree.rules import OWN, phases
from fx_rewrites.backends.iree.runtime import IreeArtifact, IreeCompiled, function_reflections, get_device
from fx_rewrites.backends.iree.state import lift_state
from fx_rewrites.backends.iree.targets import TARGETS, IreeTarget
from fx_rewrites.backends.iree.weight_layout import extra_flags
from fx_rewrites.ruleset import Phases, RuleSet

#: a torch-dialect tensor type with a dynamic size (`!torch.vtensor<[1,?],si64>`)
_DYNAMIC = re.compile(r"vtensor<\[[^\]]*\?")

#: IREE-specific first-phase rules (`backends/iree/rules/`), unioned with DEFAULT in `IreeBackend.rules`
IREE_RULES = OWN


def rules_for(target: IreeTarget) -> Phases:
    """What an IREE backend for `target` applies (`rules.phases`): DEFAULT and the IREE pack, legalize and
    guards, then the target's performance phase where it has rules (llvm-cpu's for the target's ISA)."""
    return phases(target.name, target.isa)


#: what `IreeBackend.rules` is by default (llvm-cpu)
RULES = rules_for(TARGETS["llvm-cpu"])


def _check_timeout(backend: IreeBackend, attribute: Any, seconds: float | None) -> None:
    if seconds is not None and not seconds > 0:
        raise ValueError(f"compile_timeout_s={seconds!r}: expected seconds > 0, or None for no limit")


def _check_device(backend: IreeBackend, attribute: Any, device: str | None) -> None:
    if device is None:
        return
    scheme = device.split("://", 1)[0]
    drivers = ("local-task", "local-sync") if backend.target.name == "llvm-cpu" else (backend.target.driver,)
    if scheme not in drivers:
        raise ValueError(
            f"device {device!r} is not one the {backend.target.name} code of backend {backend.name!r} runs on; "
            f"give a {' or '.join(drivers)} device (e.g. {drivers[0]!r} or '{drivers[0]}://0')"
        )


def _state_tensors(program: ExportedProgram) -> Iterator[torch.Tensor]:
    """The tensors the importer freezes: `program`'s parameters, buffers and lifted constants."""
    for value in (*program.state_dict.values(), *program.constants.values()):
        if isinstance(value, torch.Tensor):
            yield value


@attrs.frozen
class IreeBackend:
    """IREE for one compile target (`targets.TARGETS`): llvm-cpu for this host by default.

    - `target`: what iree-compile builds for and the HAL driver that runs it.
    - `rules`: DEFAULT and the IREE pack, legalize and guards, the target's performance phase (`rules_for`).
    - `flags`: iree-compile arguments the code needs (default: the target's); `perf_flags`:
      the target's measured ones, dropped for a module the compiler rejects with them.
    - `driver`: the HAL driver (default: the target's; `local-sync` runs on the calling thread).
    - `device`: an IREE device URI (`cuda://0`, `cuda://GPU-<uuid>`, `hip://1`, `vulkan://0`);
      None: the driver's first device.
    - `cache`: compiled modules, shared by every compile of this instance.
    - `refuse_wrong_forms`: refuse (IreeUnsupportedError) the forms IREE 3.13 computes wrong
      (`wrong_forms`); False compiles them, for measuring IREE itself, never for results.
    - `compile_timeout_s`: iree-compile's time limit in seconds (None: none); past it the compiler is
      stopped and `IreeCompileTimeout` raised. Default: `$FX_REWRITES_IREE_COMPILE_TIMEOUT`, else 1800.
    - `state`: where an ExportedProgram's mutated buffers (running means, counters, caches) live: "module",
      the default, keeps them in the module as mutable globals (no copy through the host per call; saved
      with it); "host" passes them at each call and writes them back to the program's tensors.
    """

    name: str = "iree"
    target: IreeTarget = TARGETS["llvm-cpu"]
    rules: RuleSet | Phases = attrs.field(default=attrs.Factory(lambda self: rules_for(self.target), takes_self=True))
    flags: tuple[str, ...] = attrs.field(default=attrs.Factory(lambda self: self.target.flags, takes_self=True))
    perf_flags: tuple[str, ...] = attrs.field(
        default=attrs.Factory(lambda self: self.target.perf_flags, takes_self=True)
    )
    driver: str = attrs.field(default=attrs.Factory(lambda self: self.target.driver, takes_self=True))
    device: str | None = attrs.field(default=None, validator=_check_device)
    cache: CompileCache = attrs.field(factory=CompileCache, eq=False, repr=False)
    refuse_wrong_forms: bool = True
    compile_timeout_s: float | None = attrs.field(factory=default_timeout, validator=_check_timeout)
    #: where an ExportedProgram's mutated buffers live between calls: "module" (mutable IREE globals, initialised
    #: from the program's values when compiled; the program's tensors are not written) or "host" (arguments of
    #: each call, read from and written back to the program's tensors: several modules sharing one state; such
    #: a module cannot be saved. The size dispatch's two sides are two functions of one module, sharing its state)
    state: str = attrs.field(default="module", validator=attrs.validators.in_(("module", "host")))

    def compile(self, program: ExportedProgram | GraphModule, example_args: Sequence[Any]) -> IreeCompiled:
        """Import, compile (or take from the cache) and load `program` on this backend's device.

        `program` is an ExportedProgram (the callable takes its user inputs,
        as `program.module()` does) or a functional ATen GraphModule whose
        placeholders carry `meta["val"]`, such as the forward graph an
        aot_autograd backend of torch.compile receives (the callable takes
        every placeholder, as the GraphModule does; see `importing`).
        `example_args` are not needed: both carry their shapes. An
        ExportedProgram's weights of `parameters.inline_limit()` bytes or
        more are parameters, served from the tensors' own memory. Code for a
        CPU this host cannot run (`for_cpu("aarch64")` on x86) is compiled and
        not loaded: it saves, and a call raises `cpus.IreeCpuError`.
        """
        compiled = self.unloaded(program)
        try:
            return attrs.evolve(compiled, function=self.load(compiled.vmfb, compiled.parameters))
        except IreeCpuError as e:  # built for a CPU this one is not (for_cpu): saved, it runs there
            return attrs.evolve(compiled, refused=e)

    def unloaded(self, program: ExportedProgram | GraphModule) -> IreeCompiled:
        """`program` compiled (`artifact`) but not loaded: it saves as a loaded one does (`save`, with or
        without `params=`) and needs no device, so it serves a target absent here (iree-cuda without a GPU);
        calling it raises. `compile` is this and `load`."""
        artifact = self.artifact(program)
        embed = functools.partial(self._embedded, artifact) if artifact.parameters else None
        pack = packer(self, artifact.mlir, artifact.parameters, artifact.graph_module)
        return IreeCompiled(
            artifact.plan,
            None,
            artifact.mlir,
            artifact.vmfb,
            artifact.key,
            artifact.from_cache,
            artifact.unsupported,
            parameters=artifact.parameters,
            embed=embed,
            pack=pack,
            # a save with params= moves the module onto the archive it wrote (`runtime.reopen`), unless the module
            # keeps state between calls (a new context would start it over)
            reopen=None if artifact.stateful else self.load_module,
        )

    def artifact(self, program: ExportedProgram | GraphModule) -> IreeArtifact:
        """Import and compile `program` (or take it from the cache) without loading it: no device needed.

        An ExportedProgram's parameters, buffers and lifted constants of `parameters.inline_limit()`
        bytes or more become named parameters (`artifact.parameters`, key -> tensor), not MLIR text; so do
        a GraphModule's get_attr tensors (the torch.compile route's frozen weights) of that size."""
        hooks = state = None
        if isinstance(program, ExportedProgram):
            prepared, plan = prepare_program(program)
            if self.state == "module":  # mutated buffers: mutable globals in the module
                plan, state = lift_state(program, plan)
            graph_module = program.graph_module
            frozen: dict[str, torch.Tensor] = {}
            limit = inline_limit()
            inline = sum(nbytes(t) for t in _state_tensors(prepared) if not is_parameter(t, limit))
        elif isinstance(program, GraphModule):
            prepared, plan = prepare_graph_module(program)
            graph_module = program
            limit = inline_limit()
            # frozen weights (get_attr tensors) of the limit or more are parameters too (`attribute_hooks`)
            frozen = attribute_tensors(prepared)
            inline = sum(nbytes(t) for t in frozen.values() if not is_parameter(t, limit))
        else:
            raise TypeError(
                "the IREE backend compiles a torch.export.ExportedProgram or a torch.fx.GraphModule, "
                f"got {type(program).__name__}"
            )
        if self.refuse_wrong_forms:  # IREE's silent wrong results: an error naming the node instead
            refusals.refuse(graph_module)  # and the forms it cannot compile, named with the fix
        memory.check(
            "the import and iree-compile",
            f"a module with {inline / 1e6:.0f} MB of weights inline",
            memory.compile_estimate(inline),
            f"lower {INLINE_ENV} (bytes from which a weight is a parameter, now {inline_limit()}), or compile "
            "a smaller model or batch",
        )
        iree = iree_modules()
        if isinstance(program, ExportedProgram):
            hooks = parameter_hooks(iree, prepared, limit=limit)
        else:
            hooks = attribute_hooks(iree, prepared, limit=limit)
        entries: dict[str, str] = {}
        needs = self.cpu_requirement()

        def entries_now() -> dict[str, str]:  # after the import: whether the module reads parameters
            entries.update(reflection(plan, self.driver, parameters=bool(hooks and hooks.tensors), cpu=needs))
            return entries

        mlir = import_mlir(iree, prepared, reflection=entries_now, hooks=hooks, state=state)
        del prepared  # the importer's copy of the graph: done with it
        flags = (*self.flags, *self.perf_flags_for(mlir))
        key = cache_key(mlir, (self.target.name, *flags))
        vmfb, cached = self.cache.get_or_compile(key, lambda: self._compile_mlir(iree, mlir, graph_module))
        return IreeArtifact(
            plan,
            mlir,
            vmfb,
            key,
            cached,
            self.target.name,
            flags,
            entries.get(UNSUPPORTED_KEY, ""),
            # None: a graph that reads no frozen tensor takes its weights as inputs (torch.compile's unfrozen graphs)
            parameters=None if isinstance(program, GraphModule) and not frozen else dict(hooks.tensors),
            graph_module=graph_module,
            stateful=state is not None and bool(state.tensors),
        )

    def _embedded(self, artifact: IreeArtifact) -> bytes:
        """`artifact`'s module compiled again with its parameters inline: a self-contained .vmfb (for
        `save(path)` without `params=`; the import is not repeated)."""
        iree = iree_modules()
        parameters = artifact.parameters or {}
        float8 = sorted(key for key, t in parameters.items() if "float8" in str(t.dtype))
        if float8:
            raise IreeUnsupportedError(
                f"a self-contained .vmfb cannot hold float8 weights ({', '.join(float8[:3])}"
                f"{', ...' if len(float8) > 3 else ''}): IREE 3.13 fails to compile them inside the module "
                '("unhandled float element bit width 8"); fix: save the weights beside it: '
                "compiled.save('model.vmfb', params='model.irpa')"
            )
        weights = sum(nbytes(t) for t in parameters.values())
        memory.check(
            "iree-compile",
            f"a self-contained .vmfb with {weights / 1e6:.0f} MB of weights inside",
            memory.compile_estimate(weights),
            "save the weights beside it: compiled.save('model.vmfb', params='model.irpa')",
        )
        mlir = artifact.mlir
        needs = self.cpu_requirement()
        if CALL_KEY in (before := reflection(artifact.plan, self.driver, parameters=True, cpu=needs)):
            after = reflection(artifact.plan, self.driver, parameters=False, cpu=needs)
            context = iree.compiler.ir.Context()
            old, new = (str(iree.compiler.ir.StringAttr.get(e[CALL_KEY], context=context)) for e in (before, after))
            mlir = mlir.replace(old, new, 1)
        mlir = embed_parameters(mlir, parameters)
        return self._compile_mlir(iree, mlir, artifact.graph_module)

    def load(self, vmfb: bytes, parameters: Mapping[str, torch.Tensor] | None = None) -> Any:
        """The `main` function of compiled `vmfb` bytes, loaded on this backend's device (`parameters`:
        the tensors it reads as parameters of scope `model`, served from their memory)."""
        return self.load_module(vmfb, parameters)["main"]

    def load_module(
        self, vmfb: bytes, parameters: Mapping[str, torch.Tensor] | None = None, *, archive: Path | None = None
    ) -> Any:
        """Compiled `vmfb` bytes loaded on this backend's device: its functions by name (`["main"]`), all in
        one VM context (they share the module's globals); `parameters` as for `load`, or `archive`: the .irpa
        it reads its weights from, mapped (`parameters.load_parameters`)."""
        refused = why_not_here(self.cpu_requirement(), "the module")
        if refused is not None:  # IREE would map the code and die of SIGILL in it, or not find its format
            raise refused
        rt = iree_modules().runtime
        uri = self.device or self.driver
        try:
            device = get_device(rt, uri)
        except (RuntimeError, ValueError) as e:
            cause = str(e).split("; ", 1)[-1].strip()
            raise IreeDeviceError(
                f"backend {self.name!r} runs {self.target.name} code on {self.target.device}, and IREE's "
                f"{self.driver!r} driver found none at {uri!r}: {cause}. Compiling needs no device "
                f"(`backends.get({self.name!r}).artifact(program)` gives the vmfb bytes); to run on this "
                "machine's CPU use the 'iree' backend",
                driver=self.driver,
                device=uri,
                cause=str(e),
            ) from None
        config = rt.Config(device=device)
        modules = []
        if archive is not None:
            modules.append(load_parameters(config, archive))
        elif parameters:
            weights = sum(nbytes(t) for t in parameters.values())
            memory.check(
                "loading", f"a module reading {weights / 1e6:.0f} MB of parameters", weights, "free memory first"
            )
            modules.append(memory_parameters(config, parameters))
        modules.append(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
        return rt.load_vm_modules(*modules, config=config)[-1]

    # -- the CPU it builds for (the `backends.base.CpuTargets` capability) -------------------------------

    #: the CPUs `for_cpu` takes (`cpus.CPUS`)
    cpus = tuple(CPUS)

    @property
    def cpu(self) -> str | None:
        """The CPU this backend's code is built for ("host", "x86-64-v3", "aarch64", or the LLVM name its
        flags give, e.g. "znver3"); None for a GPU target."""
        needs = self.cpu_requirement()
        return None if needs is None else needs["target"]

    def cpu_requirement(self) -> dict[str, Any] | None:
        """What this backend's code needs to run (`cpus.requirement` of its flags: the CPU, architecture
        and features), as a saved module records it; None for a GPU target."""
        return requirement(self.flags) if self.target.name == "llvm-cpu" else None

    def for_cpu(self, cpu: str) -> IreeBackend:
        """This backend building code for `cpu` (`cpus.CPUS`: "host", "x86-64-v3", "x86-64-v4", "aarch64"):
        its flags with that CPU's in place of the CPU, features and triple they had; the rest (name, driver,
        cache, performance flags and rules) as they are."""
        if self.target.name != "llvm-cpu":
            raise ValueError(
                f"backend {self.name!r} builds {self.target.name} code; cpu={cpu!r} applies to llvm-cpu code "
                "(backend='iree')"
            )
        device = TARGETS["llvm-cpu"].device if cpu == "host" else f"a {cpu} CPU ({CPUS[cpu].description})"
        target = attrs.evolve(self.target, flags=flags_for(cpu, self.target.flags), device=device)
        return attrs.evolve(self, target=target, flags=flags_for(cpu, self.flags))

    # -- several functions in one module (the `backends.base.ModuleBackend` capability) --------------------

    def compile_module(
        self,
        programs: Mapping[str, ExportedProgram],
        *,
        metadata: Mapping[str, Mapping[str, str]] | None = None,
        weights_as_parameters: bool = False,
        same_state: bool = False,
        state_restarts: bool = False,
    ) -> IreeModule:
        """`programs` (function name -> ExportedProgram, rules applied) compiled into one module
        (`functions.compile_functions`) and loaded: one copy of the weights, one mutable global per buffer
        they update. `metadata` goes into each function's `iree.reflection`; `weights_as_parameters`: every
        weight a parameter, whatever its size (else from `parameters.inline_limit()` bytes); `state_restarts`:
        the state may start over between uses, so a `save(params=)` moves even a module that keeps state onto
        the archive it wrote (`runtime.reopen`; its state then starts from its initial values)."""
        functions = compile_functions(
            self, programs, extra=metadata, limit=0 if weights_as_parameters else None, same_state=same_state
        )
        return loaded(self, functions, next(iter(programs.values())).graph_module, state_restarts=state_restarts)

    def read_metadata(self, path: str | os.PathLike[str]) -> dict[str, dict[str, str]]:
        """Each public function of the .vmfb at `path` -> its `iree.reflection` entries."""
        return function_reflections(path)

    def load_file(
        self,
        path: str | os.PathLike[str],
        names: Sequence[str] = ("main",),
        *,
        params: str | os.PathLike[str] | None = None,
        driver: str | None = None,
    ) -> IreeModule:
        """The module a `save` wrote to `path` with its functions `names` (weights from `params`, default the
        .irpa beside it; `driver` overrides the one it was compiled for)."""
        return from_file(path, tuple(names), params=params, driver=driver)

    def read_record(
        self, path: str | os.PathLike[str], key: str, *, params: str | os.PathLike[str] | None = None
    ) -> str | None:
        """The record `key` saved with the module at `path` (`IreeModule.save(records=)`) in its archive
        (`params`, default the .irpa beside it); None where the archive or the record is missing."""
        archive = Path(params) if params is not None else Path(path).with_suffix(".irpa")
        return read_record(archive, key) if archive.is_file() else None

    def refusal(self, graph_module: GraphModule) -> str:
        """Why this backend refuses `graph_module`: a form IREE 3.13 computes wrong (`wrong_forms`) or cannot
        compile (`refusals`), or ""."""
        if not self.refuse_wrong_forms:
            return ""
        try:
            refusals.refuse(graph_module)
        except Exception as e:
            return " ".join(str(e).split())
        return ""

    def perf_flags_for(self, mlir: str) -> tuple[str, ...]:
        """`perf_flags`, and the target's `dynamic_flags` where they are on (`perf_flags` not emptied) and the
        imported `mlir` has a tensor of a dynamic size (a Dim, or a size read at run time)."""
        if not (self.perf_flags and self.target.dynamic_flags and _DYNAMIC.search(mlir)):
            return self.perf_flags
        return (*self.perf_flags, *(f for f in self.target.dynamic_flags if f not in self.perf_flags))

    def _compile_mlir(self, iree: Any, mlir: str, gm: GraphModule) -> bytes:
        try:
            return self._run_compiler(iree, mlir, gm, (*self.flags, *self.perf_flags_for(mlir)))
        except IreeCompileTimeout:
            raise  # a second try without performance flags would wait as long again
        except IreeCompileError:
            # The performance flags can make a lowering fail that works without them (data tiling: IREE's own
            # attention, aten.logcumsumexp), so any failure is retried without them; its error is then the one
            # raised, as it would be without performance flags.
            if not self.perf_flags:
                raise
            return self._run_compiler(iree, mlir, gm, self.flags)

    def _run_compiler(
        self, iree: Any, mlir: str, gm: GraphModule, flags: Sequence[str], between: str | None = None
    ) -> bytes:
        """`run_iree_compile` with this backend's target and limit; its failure named by `gm`'s nodes."""
        flags = (*flags, *extra_flags(mlir))  # re-laid quantized weights: the fusion that reads them
        mlir = spliced(mlir)  # our own dispatches (kernels.KERNELS: the int4 matvecs) in place of their ops
        try:
            return run_iree_compile(iree, mlir, self.target.name, flags, self.compile_timeout_s, between=between)
        except IreeCompilerFailed as e:
            raise compile_error(e.diagnostics.strip(), mlir, gm) from None
