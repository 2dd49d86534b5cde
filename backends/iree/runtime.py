"""Calling a compiled module: torch <-> host arrays, and `IreeCompiled`."""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import re
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fx_rewrites.backends.convention import Plan, bind
from fx_rewrites.backends.iree.allocators import cpu_allocators, give_back_freed
from fx_rewrites.backends.iree.artifact import CALL_KEY, ArtifactError, plan_from_json, save
from fx_rewrites.backends.iree.calling import MISS, Invoker, UncheckedCall, fast_call, host_array, to_torch
from fx_rewrites.backends.iree.cpus import check
from fx_rewrites.backends.iree.element_types import element_type
from fx_rewrites.backends.iree.host_call import HostCall
from fx_rewrites.backends.iree.parameters import SCOPE, load_parameters

#: devices by URI, made once per process (as `iree.runtime.get_device` caches them); dropped at exit, before
#: nanobind's leak check (see `IreeCompiled.release`), except that a CPU device is never freed (`_keep_for_the_process`)
_DEVICES: dict[str, Any] = {}
#: IREE's CPU drivers: their devices' memory is the host's
CPU_DRIVERS = ("local-sync", "local-task")
atexit.register(_DEVICES.clear)


def get_device(rt: Any, uri: str) -> Any:
    """The IREE device at `uri`; a CPU device (`local-sync`, `local-task`) with a caching allocator bounded to a
    capacity over glibc's heap (or unbounded, or glibc's heap alone: `$FX_REWRITES_IREE_ALLOCATOR`, `allocators`).

    With IREE's default allocator every call's transient buffers are new
    allocations, and each page of them faults in again on first touch: the
    Whisper encoder's [4, 4, 500, 500] attention scores cost ~8,000 page
    faults a call, 170 -> 145 ms of CPU time (iree-benchmark-module,
    `--device_allocator=caching`). The caching allocator keeps freed blocks
    for the next call, as torch's CPU allocator reuses its heap: the memory
    a process's calls freed stays with it until the device is dropped (at
    exit). Unbounded it keeps every size it was asked for (a MoE prefill's
    transients take sizes from the routing: +1.0-1.6 GB a new prompt), so
    by default its pool is bounded and what passes the bound goes back to
    glibc's heap, which reuses it for any size (`allocators.py`).
    """
    device = _DEVICES.get(uri)
    if device is None:
        if uri.split(":", 1)[0] in CPU_DRIVERS:
            device = rt.get_driver(uri).create_device_by_uri(uri, allocators=cpu_allocators())
            _keep_for_the_process(rt, device)
        else:
            device = rt.get_device(uri)
        _DEVICES[uri] = device
    return device


def _keep_for_the_process(rt: Any, device: Any) -> None:
    """Never free `device`: a call hands out results over its buffers (`host_call`, `calling.Invoker`), and one may
    be held to the interpreter's shutdown, which tears modules down in no order a buffer's release could rely on (a
    buffer released after its device crashed the process). One reference more than Python drops; the process's exit
    frees the memory. nanobind's shutdown report of objects still alive would list the device (and every result a
    program still holds), so it is turned off."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(device))
    disable = getattr(rt._binding, "disable_leak_checker", None)
    if disable is not None:
        disable()


def is_host_device(device: Any) -> bool:
    """Whether `device` is a CPU device `get_device` made: its memory is the host's, so a call may hand an input
    array over in place (`calling.Invoker`) instead of copying it into a device buffer."""
    return any(d is device for uri, d in _DEVICES.items() if uri.split(":", 1)[0] in CPU_DRIVERS)


def to_host(value: Any) -> Any:
    """What the IREE runtime takes for `value`: a numpy array for a tensor, a Python number as is."""
    return host_array(value) if isinstance(value, torch.Tensor) else value


def from_device(value: Any, dtype: torch.dtype | None) -> Any:
    """A torch tensor (of `dtype`, when given) for one result of the compiled function."""
    import numpy as np

    array = value.to_host() if hasattr(value, "to_host") else value
    if not isinstance(array, np.ndarray):
        return array  # a scalar result (SymInt output)
    return to_torch(np.array(array, copy=True), dtype)


@attrs.frozen(eq=False)
class IreeArtifact:
    """A compiled, unloaded program: `vmfb` bytes for `target` (built with `flags`), the call plan,
    the imported MLIR, the cache key and whether the bytes came from the cache."""

    plan: Plan = attrs.field(repr=False)
    mlir: str = attrs.field(repr=False)
    vmfb: bytes = attrs.field(repr=False)
    key: str = ""
    from_cache: bool = False
    target: str = "llvm-cpu"
    flags: tuple[str, ...] = ()
    #: why the program cannot be saved with its call convention ("" when it can)
    unsupported: str = ""
    #: the weights the module reads as parameters (scope `model`), by key: the program's own tensors
    #: (None for a GraphModule, whose weights are inputs)
    parameters: Mapping[str, torch.Tensor] | None = attrs.field(default=None, repr=False)
    #: the graph it was imported from (names nodes in a later compile's errors)
    graph_module: Any = attrs.field(default=None, repr=False)
    #: it keeps state between calls (buffers it updates, as mutable globals)
    stateful: bool = False


@attrs.define(eq=False)
class IreeCompiled:
    """A compiled program: call it like `program.module()` (or the GraphModule it was compiled from).

    `mlir` is the imported module text, `key` its cache key, `vmfb` the
    compiled bytes and `from_cache` whether they came from the cache.
    `parameters` are the weights the module reads as parameters (key ->
    tensor; empty for a module that holds all its weights, None for one
    that takes them as inputs). A program that updates buffers keeps them in
    the module (mutable globals): each call goes on from the state the last
    one left, and the program's tensors are not written (docs/deploy.md).
    """

    plan: Plan = attrs.field(repr=False)
    function: Any = attrs.field(repr=False)
    mlir: str = attrs.field(repr=False)
    vmfb: bytes = attrs.field(repr=False)
    key: str = ""
    from_cache: bool = False
    #: why `save` cannot write this program ("" when it can)
    unsupported: str = attrs.field(default="", repr=False)
    #: the weights the module reads as parameters (scope `model`), by key; None: it takes its weights as
    #: inputs (a GraphModule from torch.compile) or was loaded
    parameters: Mapping[str, torch.Tensor] | None = attrs.field(default=None, repr=False)
    #: compiles the module again with its parameters inside (a self-contained .vmfb): () -> vmfb
    embed: Callable[[], bytes] | None = attrs.field(default=None, repr=False)
    #: the parameter archive a loaded module reads its weights from
    archive: Path | None = None
    #: writes the parameters to an .irpa packed as the module reads them and returns that module
    #: (`encoding.pack`; None: the module packs nothing when it loads)
    pack: Callable[[Path, Mapping[str, torch.Tensor]], bytes | None] | None = attrs.field(default=None, repr=False)
    #: why it was not loaded, raised by a call: built for a CPU this host cannot run (`cpus.IreeCpuError`)
    refused: Exception | None = attrs.field(default=None, repr=False)
    #: loads a module's bytes with its weights read in place from a mapped archive, `(vmfb, archive=path)` ->
    #: its functions by name: how `save(params=)` moves the module onto the archive it wrote (`reopen`); None
    #: where the module stays as it is (it keeps state between calls, which a new context would start over, and
    #: was not compiled with `state_restarts`)
    reopen: Callable[..., Mapping[str, Any]] | None = attrs.field(default=None, repr=False)
    #: the archive the module reads its weights from since a `save(params=)` moved it there (None: its own)
    reads: Path | None = None
    #: the call path for positional tensors that fit (`calling.fast_call`), built on the first call for
    #: `_fast_for` (the function it calls; rebuilt when `function` changes)
    _fast: Any = attrs.field(init=False, default=None, repr=False)
    _fast_for: Any = attrs.field(init=False, default=None, repr=False)

    def save(self, path: str | os.PathLike[str], *, params: str | os.PathLike[str] | None = None) -> None:
        """Write the module to `path` (a .vmfb `iree-run-module` runs, and `fx_rewrites.load` reads back
        with its call convention); with `params`, the parameters go to that IREE parameter archive (.irpa)
        and the .vmfb is the one already compiled. Without, the .vmfb holds every weight (a module that
        reads parameters is compiled again with them inside: use `params=` for large models). On llvm-cpu the
        archive holds the weights packed as the module's kernels read them (`encoding.py`: the saved module
        reads them in place from the mapped file, with no copy at load; and this module then reads them from
        there too, its own packed copy freed: `reopen`). Buffers the
        program updates are saved with the values they had when it was compiled (its initial state)."""
        save_and_reopen(self, {"main": self}, path, params)

    def unchecked(self) -> Callable[..., Any]:
        """This function as a call of the module function on the tensors' memory, without the call convention's
        per-call checks (~0.1 ms a call): for a caller that builds every input itself, of the compiled dtypes
        and shapes, in the plan's order, and reads one result (`compile_lm`'s generate loop; its greedy steps call
        `reduced` of the `UncheckedCall`: numpy arrays in, the argmax read off the mapped logits). Any other plan
        is called as is (self)."""
        plan, function = self.plan, self.function
        if function is None or plan.args != tuple(range(len(plan.args))) or len(plan.outputs) != 1:
            return self
        output = plan.outputs[0]
        if output.result != 0 or output.write is not None:
            return self

        invoker = Invoker.of(function)
        if invoker is not None:
            return UncheckedCall(invoker, output.dtype)

        def call(*tensors: torch.Tensor) -> torch.Tensor:
            result = function(*(t.contiguous().numpy() for t in tensors))
            return from_device(result[0] if isinstance(result, (tuple, list)) else result, output.dtype)

        return call

    def run_command(
        self, vmfb: str | os.PathLike[str], params: str | os.PathLike[str] | None = None, driver: str = "local-task"
    ) -> str:
        """The iree-run-module command line that runs this module saved at `vmfb` (weights in `params`) on
        `driver`, with zero-filled inputs of the compiled shapes where the convention gives them all."""
        argv = ["iree-run-module", f"--device={driver}", f"--module={vmfb}", "--function=main"]
        if params is not None:
            argv.append(f"--parameters={SCOPE}={params}")
        return " ".join(shlex.quote(a) for a in argv + [f"--input={value}" for value in run_inputs(self.plan)])

    def release(self) -> None:
        """Drop the runtime objects (the function, its VM context and device); calls fail after this.

        IREE's runtime objects are nanobind instances: one still alive when Python shuts down makes
        nanobind print a page of `leaked ...` lines, so the torch.compile glue releases its graphs at exit.
        """
        self.function = self._fast = self._fast_for = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and self.function is not None:
            if self._fast_for is not self.function:
                host_memory = is_host_device(getattr(self.function, "_device", None))
                host = HostCall.of(self.plan, self.function) if host_memory else None
                self._fast = host or fast_call(self.plan, self.function, host_memory)
                self._fast_for = self.function
            if self._fast is not None and (out := self._fast(args)) is not MISS:
                return out
        return self.call_bound(*args, **kwargs)

    def call_bound(self, *args: Any, **kwargs: Any) -> Any:
        """The general path of a call: `convention.bind` (its checks name any mismatch), iree.runtime's
        invoker, each result copied out of its `DeviceArray`, mutations written back. `__call__` takes it
        for every call that is not positional tensors of the compiled dtypes and sizes (`calling.fast_call`)."""
        if self.function is None:
            if self.refused is not None:
                raise self.refused.with_traceback(None)
            raise RuntimeError(
                "this compiled module is not loaded (released, or built by IreeBackend.unloaded for a device absent "
                "here): compile or load it on a machine with its device"
            )
        plan = self.plan
        flat = bind(plan, args, kwargs)
        results = self.function(*(to_host(flat[a] if isinstance(a, int) else a) for a in plan.args))
        if not isinstance(results, (tuple, list)):
            results = (results,)
        user_outputs = []
        for out in plan.outputs:
            value = out.constant if out.result is None else from_device(results[out.result], out.dtype)
            if out.write is None:
                user_outputs.append(value)
                continue
            with torch.no_grad():  # mutations land where program.module() puts them
                (flat[out.write] if isinstance(out.write, int) else out.write).copy_(value)
        return pytree.tree_unflatten(user_outputs, plan.out_spec)


def save_and_reopen(
    module: Any,
    calls: Mapping[str, IreeCompiled],
    path: str | os.PathLike[str],
    params: str | os.PathLike[str] | None,
    records: Mapping[str, str] | None = None,
) -> None:
    """`artifact.save` of a compiled module (an `IreeCompiled` or a module of several functions: its .vmfb and
    the weights it holds); with `params`, its functions `calls` then read the saved archive (`reopen`)."""
    packed = save(
        module.vmfb,
        path,
        unsupported=module.unsupported,
        params=params,
        parameters=module.parameters,
        embed=module.embed,
        archive=module.archive,
        pack=module.pack,
        records=records,
    )
    if packed is not None and params is not None:
        reopen(calls, packed, Path(params))


def reopen(calls: Mapping[str, IreeCompiled], packed: bytes, archive: Path) -> None:
    """`calls` (the functions of one loaded module, by name) re-opened on the module `packed`, which reads its
    weights packed from `archive` (a save's `encoding.pack`), mapped: the pages a later `fx_rewrites.load` of
    the saved files reads too, shared with the page cache. The copy of the weights the module packed when it
    started (their size again, beside the model's tensors) is freed, and the devices' caching allocators give
    back what was freed. A module that keeps state between calls (unless it may start over: `compile_module(...,
    state_restarts=True)`), or is not loaded, stays as it is.
    `encoding.pack` renames each new archive into place (`archive.replacing`): a later save to the same path
    leaves the mapped file as it was."""
    first = next(iter(calls.values()))
    if first.reopen is None or any(c.function is None for c in calls.values()):
        return
    bound = first.reopen(packed, archive=archive)
    for name, call in calls.items():
        call.function, call._fast, call._fast_for = bound[name], None, None
        call.reads = archive.resolve()
    del bound
    gc.collect()  # the old function's VM context can sit in a reference cycle: freed now, not at some later pass
    trim_devices()


def trim_devices() -> None:
    """Give back the memory the devices' caching allocators keep for reuse (`get_device`): what was freed, and
    what glibc's heap then keeps of it (`allocators.give_back_freed`: the default allocator keeps freed blocks)."""
    for device in _DEVICES.values():
        device.allocator.trim()
    give_back_freed()


def run_inputs(plan: Plan) -> list[str]:
    """iree-run-module `--input=` values for `plan`'s tensor inputs, zero-filled ("2x3x8x8xf32=0"), or []
    when the convention does not give every one a static shape and a known element type."""
    out = []
    for i in plan.args:
        item = plan.inputs[i] if isinstance(i, int) and i < len(plan.inputs) else None
        if item is None or item.kind != "tensor" or not all(isinstance(d, int) for d in item.shape):
            return []
        element = element_type(item.dtype)
        if element is None:
            return []
        out.append("x".join([*(str(d) for d in item.shape), element]) + "=0")
    return out


def _looks_like_vmfb(head: bytes) -> bool:
    """IREE writes a zip whose first entry, module.fb, is a FlatBuffer with the identifier "IREE"."""
    return head[:4] == b"PK\x03\x04" and b"IREE" in head[:256]


def _probe(path: Path) -> Any:
    """`path`'s IREE module, mapped for reading its functions' reflection (ArtifactError: not a .vmfb)."""
    import iree.runtime

    if not path.is_file():
        raise ArtifactError(f"no such file: {path}. Fix: check the path (a .vmfb written by compiled.save).")
    with path.open("rb") as f:
        head = f.read(256)
    if not _looks_like_vmfb(head):
        raise ArtifactError(f"{path} is not an IREE module (.vmfb). Fix: give the file compiled.save wrote.")
    return iree.runtime.VmModule.mmap(iree.runtime.VmInstance(), str(path))


def function_reflections(path: str | Path) -> dict[str, dict[str, str]]:
    """Each public function of the .vmfb at `path` -> its `iree.reflection` entries."""
    probe = _probe(Path(path))
    return {name: dict(probe.lookup_function(name).reflection) for name in probe.function_names}


#: IREE's error for a parameter the archive lacks (`iree/io/parameter_index.c`)
_MISSING_KEY = re.compile(r"no parameter found in index with key '([^']*)'")


def _bind(path: Path, doc: dict[str, Any], params: str | Path | None, driver: str | None) -> tuple[Any, Path | None]:
    """The module at `path` loaded (with its parameter archive when `doc` says it reads one): its functions
    by name, in one VM context; and the archive."""
    import iree.runtime

    config = iree.runtime.Config(device=get_device(iree.runtime, driver or doc["driver"]))
    modules = []
    archive = None
    if doc["parameters"] is not None:
        archive = Path(params) if params is not None else path.with_suffix(".irpa")
        if not archive.is_file():
            raise ArtifactError(
                f"{path} reads its weights from a parameter archive, and {archive} does not exist. "
                "Fix: pass params='PATH.irpa' (the file written with it)."
            )
        modules.append(load_parameters(config, archive, doc["parameters"]["scope"]))
    elif params is not None:
        raise ArtifactError(f"{path} holds its weights itself; it reads no parameter archive. Fix: leave params= out.")
    modules.append(iree.runtime.VmModule.mmap(config.vm_instance, str(path)))
    try:
        return iree.runtime.load_vm_modules(*modules, config=config)[-1], archive
    except ValueError as e:
        missing = _MISSING_KEY.search(str(e))
        if archive is None or missing is None:
            raise
        raise ArtifactError(
            f"{path} reads the parameter {missing[1]!r}, which {archive} does not hold (the first such key it "
            f"looked up; the archive holds {_archive_keys(archive)}). The archive was written for another module, "
            "or by a save that left it out. Fix: save the compiled module again, .vmfb and .irpa together "
            "(compiled.save(path, params=...)), and load the pair."
        ) from None


def _archive_keys(path: Path, shown: int = 8) -> str:
    import iree.runtime

    index = iree.runtime.ParameterIndex()
    index.load(str(path), mmap=True)
    keys = sorted(index[i].key for i in range(len(index)))
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{len(keys)} keys: " + ", ".join(repr(k) for k in keys[:shown]) + more


def load(path: str | Path, *, params: str | Path | None = None, driver: str | None = None) -> Any:
    """An `IreeCompiled` for a .vmfb written by `save` (its weights from `params`, or the .irpa beside it)."""
    return load_functions(path, ("main",), params=params, driver=driver)["main"]


def load_functions(
    path: str | Path, names: tuple[str, ...], *, params: str | Path | None = None, driver: str | None = None
) -> dict[str, IreeCompiled]:
    """An `IreeCompiled` per function `names` of the .vmfb at `path`, all in one VM context (they share the
    module's state); each function's call convention comes from its own reflection."""
    path = Path(path)
    probe = _probe(path)
    docs = {}
    for name in names:
        entries = probe.lookup_function(name).reflection if name in probe.function_names else {}
        if CALL_KEY not in entries:
            raise ArtifactError(
                f"{path} carries no fx-rewrites call convention for function {name!r} (it was not written by "
                "compiled.save); run it with iree-run-module or iree.runtime directly"
            )
        docs[name] = plan_from_json(entries[CALL_KEY], str(path))
    if (driver or docs[names[0]][1]["driver"]).split(":", 1)[0] in CPU_DRIVERS:
        check(docs[names[0]][1].get("cpu"), str(path))  # before IREE maps code this CPU cannot run
    bound, archive = _bind(path, docs[names[0]][1], params, driver)
    vmfb = path.read_bytes()
    return {name: IreeCompiled(plan, bound[name], "", vmfb, archive=archive) for name, (plan, _) in docs.items()}
