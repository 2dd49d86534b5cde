"""Weights saved as the module reads them: IREE's parameter encoder, run when a module is saved with `params=`.

With data tiling (llvm-cpu's performance flags, `targets.py`) a module packs each matmul weight into the tiles
its kernels read when it starts. Loaded from an .irpa that is a second copy of the weights beside the archive's
mapped pages: a 1B Llama of 3.81 GB loaded at 7.61 GB. `iree-compile --iree-parameter-encoder-output-file`
splits that packing out into an encoder module, and the module then reads every weight, packed or not, as it
is (`consolidate` mode: the encoder writes them all, as `parameter<N>` entries of scope `model`). `pack`
compiles both (the compile cache keeps them), runs the
encoder over the module's own tensors (served from their memory) and has it write its output into the .irpa
through a file descriptor (`archive.reserve` lays the file out, the encoder fills the entries with pwrite):
neither the packed weights nor the archive pass through the process's memory. `fx_rewrites.load` maps the
archive and the module reads it in place: its pages count once, as they are read (docs/deploy.md).

The encoder does not write every weight: it leaves out one whose packing it refuses (IREE 3.13's
`SplitParameterEncoder` rejects an expression whose output is more than 1.2x its input: a router's
[4, 32] weight packed for a decode step pads to 16 rows, 4x) and any it cannot evaluate offline, and the
module then packs that weight itself, read by its own key. The state a module updates (a KV cache) starts
from parameters of its own keys too. `read_by_key` finds those keys in the module, and `pack` writes their
tensors into the archive as they are, beside the encoder's output.

`run_encoder` is IREE's `iree-encode-parameters` tool (not in the 3.13 wheels, `tools/iree-encode-parameters-main.c`)
over the runtime's Python API: the encoder's `indices` function lists the output parameters, `steps` the work,
and `encode(steps, wait fence, signal fence)` does it.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fx_rewrites.backends.iree import archive
from fx_rewrites.backends.iree.cache import cache_key
from fx_rewrites.backends.iree.cpus import why_not_here
from fx_rewrites.backends.iree.errors import IreeCompileError
from fx_rewrites.backends.iree.invoke import IreeCompilerFailed, run_iree_compile
from fx_rewrites.backends.iree.parameters import SCOPE, _bytes
from fx_rewrites.backends.iree.weight_layout import extra_flags

DATA_TILING = "--iree-global-opt-data-tiling"
#: the encoder writes the weights it packs or passes through into the scope the module reads them from, so
#: a packed .irpa is run as any other (`--parameters=model=model.irpa`)
_SPLIT = ("--iree-parameter-encoder-mode=consolidate", f"--iree-parameter-encoder-output-scope={SCOPE}")
#: a module of several functions (`compile_lm`'s prefill and decode) hoists the packing of a weight they share once
#: per function, into initializers of their own; iree-compile merges them in its stream phase, after the encoder
#: is split out, so the encoder would write each weight packed once per function (docs/iree-3.13-findings.md
#: section 33). Run after global optimization, this merges them first: the initializers as one, equal packings as one
#: value (cse), the globals it is stored into as one.
SHARE_PACKED = (
    "builtin.module(iree-util-combine-initializers,util.initializer(cse),iree-util-fuse-globals,"
    "iree-util-fold-globals,symbol-dce)"
)


def packer(
    backend: Any, mlir: str, parameters: Mapping[str, torch.Tensor] | None, gm: Any = None, *, functions: int = 1
) -> Callable[[Path], bytes | None] | None:
    """`artifact.save`'s `pack` for a module compiled by `backend` from `mlir` (of that many public `functions`),
    reading `parameters`: None where the module packs nothing when it loads (no data tiling), or is built for a
    CPU this host cannot run (the encoder is built for it too: the module packs its weights where it runs)."""
    if not parameters or backend.target.name != "llvm-cpu" or DATA_TILING not in backend.perf_flags:
        return None
    if extra_flags(mlir):
        # quantized weights re-laid as its kernels read them (`weight_layout`): IREE's encoder leaves those
        # out of the archive it writes (the loaded module then finds no `...blocked_rows` entry), so the
        # archive is written as it is
        return None
    if why_not_here(backend.cpu_requirement()) is not None:  # the encoder is code for that CPU: it runs there
        return None
    return functools.partial(pack, backend, mlir, parameters, gm, shared=functions > 1)


def pack(
    backend: Any,
    mlir: str,
    parameters: Mapping[str, torch.Tensor],
    gm: Any,
    path: Path,
    also: Mapping[str, torch.Tensor] | None = None,
    *,
    shared: bool = False,
) -> bytes | None:
    """Write `parameters` to the .irpa at `path` as the module reads them, with `also` (key -> tensor, which
    the module does not read) as they are, and return that module; None, with a warning, where IREE cannot
    split the packing out. `shared`: the module has several functions reading the same weights (each packed
    weight written once: `SHARE_PACKED`)."""
    from fx_rewrites.backends.iree.importing import iree_modules

    iree = iree_modules()
    try:
        main, encoder = compile_split(backend, iree, mlir, gm, shared=shared)
        # what the module still reads by its own key (a weight the encoder left out, a state's initial value)
        kept = {key: parameters[key] for key in read_by_key(main, parameters)} | dict(also or {})
        with archive.replacing(path) as new:  # a module mapping the file now at `path` keeps its pages
            run_encoder(backend, encoder, parameters, new, kept)
    except NothingToPack:
        return None
    except (IreeCompileError, IreeCompilerFailed, NotImplementedError) as e:
        warnings.warn(
            f"the weights are saved as they are, not packed for the module's kernels ({type(e).__name__}: "
            f"{str(e)[:300]}): the loaded module packs them when it starts, a second copy of their size in memory",
            stacklevel=3,
        )
        return None
    return main


def read_by_key(vmfb: bytes, keys: Iterable[str]) -> list[str]:
    """The `keys` the compiled module `vmfb` may read by name: those whose bytes it holds (the module names the
    parameters it loads in its read-only data, uncompressed). A key that is only part of a longer name, or of
    other data, is listed too: its tensor is written needlessly, never missed."""
    return [key for key in keys if key.encode() in vmfb]


class NothingToPack(Exception):
    """The module packs no weight when it starts: the archive is written as it is."""


def compile_split(backend: Any, iree: Any, mlir: str, gm: Any = None, *, shared: bool = False) -> tuple[bytes, bytes]:
    """`mlir` compiled by `backend` with its weights' packing split out: the module (reading the packed
    weights) and the encoder module, each kept in the backend's compile cache. `shared`: a weight several
    functions pack alike is packed once (`SHARE_PACKED`)."""
    flags = (*backend.flags, *backend.perf_flags_for(mlir))
    between = SHARE_PACKED if shared else None
    key = cache_key(mlir, (backend.target.name, *flags, *_SPLIT, *([between] if between else [])))
    made: dict[str, bytes] = {}

    def both() -> bytes:
        with tempfile.TemporaryDirectory(prefix="fx-rewrites-encoder-") as tmp:
            text = Path(tmp) / "encoder.mlir"
            split = (*flags, *_SPLIT, f"--iree-parameter-encoder-output-file={text}")
            main = backend._run_compiler(iree, mlir, gm, split, between=between)
            if not text.exists():  # IREE found nothing to pack (no matmul weights): no encoder
                raise NothingToPack
            made["encoder"] = run_iree_compile(
                iree, text.read_text(), backend.target.name, flags, backend.compile_timeout_s
            )
        # cached before the module is: a process that waited for this compile (`cache.compiling`) finds both
        backend.cache.put(key + "-encoder", made["encoder"])
        return main

    main, _ = backend.cache.get_or_compile(key, both)
    encoder, _ = backend.cache.get_or_compile(key + "-encoder", lambda: made.get("encoder") or _encoder_of(both, made))
    return main, encoder


def _encoder_of(both: Callable[[], bytes], made: dict[str, bytes]) -> bytes:
    both()  # the module was cached and its encoder was not: compile both again
    return made["encoder"]


def _text(ref: Any, rt: Any) -> str:
    return bytes(memoryview(ref.deref(rt.VmBuffer))).decode()


def _call(rt: Any, context: Any, function: Any) -> Any:
    results = rt.VmVariantList(1)
    context.invoke(function, rt.VmVariantList(0), results)
    return results.get_as_list(0)


def run_encoder(
    backend: Any,
    encoder_vmfb: bytes,
    parameters: Mapping[str, torch.Tensor],
    path: Path,
    also: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Run the encoder module over `parameters` (scope `model`, served from the tensors' memory) on
    `backend`'s device; its output parameters (`parameter<N>` of the same scope) are written into a new .irpa
    at `path`, with `also` (key -> tensor) as they are. Inputs and outputs are entries of one index (IREE looks
    a key up in the first provider of its scope only)."""
    from fx_rewrites.backends.iree.importing import iree_modules
    from fx_rewrites.backends.iree.runtime import get_device

    rt = iree_modules().runtime
    device = get_device(rt, backend.device or backend.driver)
    instance = rt.Config(device=device).vm_instance
    encoder = rt.VmModule.copy_buffer(instance, encoder_vmfb)
    targets: dict[str, dict[str, Any]] = {}
    for name in encoder.function_names:
        function = encoder.lookup_function(name)
        attributes = dict(function.reflection)
        if "iree.encode.target" in attributes:
            targets.setdefault(attributes["iree.encode.target"], {})[attributes["iree.encode.function"]] = function
    functions = next(iter(targets.values()), {})  # the first target, as the tool picks without --target
    if not {"indices", "steps", "encode"} <= functions.keys():
        raise NotImplementedError(f"the encoder module has functions {sorted(functions)} for its first target")
    inputs = rt.ParameterIndex()
    for key, tensor in parameters.items():
        inputs.add_buffer(key, _bytes(tensor))
    hal = rt.create_hal_module(instance, device)

    def context() -> Any:
        io = rt.create_io_parameters_module(instance, inputs.create_provider(scope=SCOPE))
        return rt.VmContext(instance, modules=[hal, io, encoder])

    entries = []  # each scope: [name, [entry: [type, key, metadata, length, alignment (data) | pattern...]]]
    scopes = _call(rt, context(), functions["indices"])
    for i in range(scopes.size):
        scope = scopes.get_as_list(i)
        name, listed = _text(scope.get_variant(0), rt), scope.get_as_list(1)
        for j in range(listed.size):
            entry = listed.get_as_list(j)
            kind, key = entry.get_variant(0), _text(entry.get_variant(1), rt)
            if name != SCOPE or kind != 1 or key in parameters:
                raise NotImplementedError(f"encoder output {name}::{key} of kind {kind} (expected new data in {SCOPE})")
            entries.append((key, int(entry.get_variant(3)), int(entry.get_variant(4))))
    kept = {key: _bytes(tensor) for key, tensor in (also or {}).items()}
    layout = [*entries, *((key, array.nbytes, archive.DATA_ALIGNMENT) for key, array in kept.items())]
    offsets = archive.reserve(layout, path)
    fd = os.open(path, os.O_RDWR)
    running = handle = None
    try:
        for array, offset in zip(kept.values(), offsets[len(entries) :], strict=True):
            os.pwrite(fd, memoryview(array), offset)
        handle = rt.FileHandle.wrap_fd(fd, readable=True, writable=True)
        for (key, length, _), offset in zip(entries, offsets[: len(entries)], strict=True):
            inputs.add_from_file_handle(key, handle, length, offset)
        running = context()
        arguments = rt.VmVariantList(3)
        arguments.push_list(_call(rt, running, functions["steps"]))
        semaphore = device.create_semaphore(0)
        done = rt.HalFence.create_at(semaphore, 1)
        arguments.push_ref(rt.HalFence.create_at(semaphore, 0))
        arguments.push_ref(done)
        running.invoke(functions["encode"], arguments, rt.VmVariantList(0))
        done.wait()
    finally:
        running = handle = inputs = None  # the runtime's references to the file first
        os.close(fd)
