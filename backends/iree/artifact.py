"""Compiled programs as files: a .vmfb that carries its own call convention, and optionally an .irpa of weights.

`iree-run-module --module=model.vmfb --function=main` runs the file as is.
The call convention (`convention.Plan`: the pytree specs of inputs and
outputs, each input's dtype and shape, the constants torch.export
specialised, where each result goes) is JSON in the `iree.reflection`
attribute of `main`, which the runtime reads back (`VmFunction.reflection`),
so one file is the whole artifact. `load` reads that JSON and hands the
module to IREE's runtime: no pickle, nothing from the file runs in Python.
(The module's compiled kernels are machine code, as in any shared library:
load artifacts you trust.)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fx_rewrites.backends.base import ArtifactError
from fx_rewrites.backends.convention import Input, Output, Plan
from fx_rewrites.backends.iree.archive import replacing
from fx_rewrites.backends.iree.parameters import SCOPE

#: `iree.reflection` keys on `main`: the convention (JSON), or why it could not be written
CALL_KEY = "fx_rewrites.call"
UNSUPPORTED_KEY = "fx_rewrites.unsupported"
FORMAT = "fx-rewrites.iree-call"
VERSION = 1
_SCALARS = (type(None), bool, int, float, str)


def _dtype(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _torch_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ArtifactError(f"unknown dtype {name!r} in the call convention")
    return dtype


def _constant(value: Any, what: str) -> Any:
    if not isinstance(value, _SCALARS):
        raise ArtifactError(f"{what} is a constant {type(value).__name__} ({value!r:.60}), which JSON cannot hold")
    return value


def reflection(
    plan: Plan, driver: str, parameters: bool = False, cpu: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """The `iree.reflection` entries for `main`: the convention as JSON, or why it cannot be one."""
    try:
        return {CALL_KEY: plan_json(plan, driver, parameters, cpu)}
    except ArtifactError as e:
        return {UNSUPPORTED_KEY: str(e)}


def plan_json(plan: Plan, driver: str, parameters: bool = False, cpu: Mapping[str, Any] | None = None) -> str:
    """`plan` as JSON (ArtifactError for what JSON cannot carry: state passed by the host, custom pytree types).
    `cpu`: what the code needs to run (`cpus.requirement`; llvm-cpu), checked when the file is loaded; a
    document without it (written before modules recorded their CPU, or for a GPU) is loaded unchecked."""
    if any(isinstance(a, torch.Tensor) for a in plan.args) or any(
        isinstance(o.write, torch.Tensor) for o in plan.outputs
    ):
        raise ArtifactError(
            "the program mutates buffers and was compiled to keep that state in the program's tensors "
            "(IreeBackend(state='host')), which a saved artifact cannot carry; compile with state='module' (the "
            "default), which keeps it in the module"
        )
    try:
        in_spec, out_spec = pytree.treespec_dumps(plan.in_spec), pytree.treespec_dumps(plan.out_spec)
    except Exception as e:
        raise ArtifactError(
            f"the inputs or outputs use a pytree type that cannot be written as JSON ({type(e).__name__}: {e}); "
            "register it with torch.utils._pytree.register_pytree_node(..., serialized_type_name=...)"
        ) from None
    inputs = [
        {
            "name": i.name,
            "path": i.path,
            "kind": i.kind,
            "dtype": _dtype(i.dtype),
            "shape": list(i.shape),
            "value": _constant(i.value, f"input {i.name or i.path}"),
        }
        for i in plan.inputs
    ]
    outputs = [
        {
            "result": o.result,
            "constant": _constant(o.constant, f"output {n}"),
            "dtype": _dtype(o.dtype),
            "write": o.write,
        }
        for n, o in enumerate(plan.outputs)
    ]
    document = {
        "format": FORMAT,
        "version": VERSION,
        "made_by": {"fx_rewrites": _version("fx-rewrites"), "iree_compiler": _version("iree-base-compiler")},
        "driver": driver,
        "in_spec": in_spec,
        "out_spec": out_spec,
        "args": list(plan.args),
        "inputs": inputs,
        "outputs": outputs,
        "ranges": {k: list(v) for k, v in plan.ranges.items()},
        "parameters": {"scope": SCOPE} if parameters else None,
    }
    if cpu is not None:  # optional, so version 1 still reads both ways (an older reader ignores the key)
        document["cpu"] = dict(cpu)
    if any(plan.unwritten):  # optional too: without it every argument is copied
        document["unwritten"] = list(plan.unwritten)
    if any(plan.fresh):  # and without it every result
        document["fresh"] = list(plan.fresh)
    return json.dumps(document, separators=(",", ":"))


def _version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def plan_from_json(text: str, source: str) -> tuple[Plan, dict[str, Any]]:
    """The Plan a `plan_json` document describes, and the document."""
    try:
        doc = json.loads(text)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ArtifactError(
                f"{source} holds call convention {doc.get('format')!r} version {doc.get('version')!r}; this "
                f"fx-rewrites reads {FORMAT!r} version {VERSION}. Fix: save it again with this version."
            )
        inputs = tuple(
            Input(i["name"], i["path"], i["kind"], _torch_dtype(i["dtype"]), tuple(i["shape"]), i["value"])
            for i in doc["inputs"]
        )
        outputs = tuple(
            Output(o["result"], o["constant"], _torch_dtype(o["dtype"]), o["write"]) for o in doc["outputs"]
        )
        ranges = {k: (v[0], v[1]) for k, v in doc["ranges"].items()}
        in_spec, out_spec = pytree.treespec_loads(doc["in_spec"]), pytree.treespec_loads(doc["out_spec"])
        unwritten = tuple(bool(u) for u in doc.get("unwritten", ()))
        fresh = tuple(bool(f) for f in doc.get("fresh", ()))
        return Plan(in_spec, out_spec, tuple(doc["args"]), outputs, inputs, ranges, unwritten, fresh), doc
    except ArtifactError:
        raise
    except Exception as e:  # a damaged document, or a pytree type this process has not registered
        raise ArtifactError(
            f"{source}'s call convention cannot be read: {type(e).__name__}: {e}. Fix: if it names a pytree type "
            "(a model's output class), import the module that registers it first; else save the artifact again."
        ) from None


# ----------------------------------------------------------------------------- save and load


def save(
    vmfb: bytes,
    path: str | Path,
    *,
    unsupported: str = "",
    params: str | Path | None = None,
    parameters: Mapping[str, torch.Tensor] | None = None,
    embed: Callable[[], bytes] | None = None,
    archive: Path | None = None,
    pack: Callable[[Path, Mapping[str, torch.Tensor]], bytes | None] | None = None,
    records: Mapping[str, str] | None = None,
) -> bytes | None:
    """Write `vmfb` to `path`. `parameters` are the weights it reads (key -> tensor; None for a module that
    takes its weights as inputs or was loaded from a self-contained file): with `params`, they go to that
    .irpa (written even when empty, so the documented `--parameters=` command runs); `pack(params)`, where
    given, writes them there as the module reads them (packed, `encoding.py`) and returns that module (None:
    it could not, the plain archive is written); without `params`, `embed` compiles the self-contained module
    written instead. A module loaded with its archive copies that. Returns the module written when it reads
    the archive at `params` packed (None otherwise). `records`: short texts (key -> text) written into the
    archive beside the weights, which the module does not read (`read_record`): what tells apart files whose
    compiled code is the same (a tensor-parallel model's ranks); they need `params`."""
    from fx_rewrites.backends.iree.parameters import write_archive

    if unsupported:
        raise ArtifactError(f"cannot save this compiled program: {unsupported}.")
    if records and params is None:
        raise ArtifactError(
            f"this module is saved with records ({', '.join(records)}) that go into its parameter archive. Fix: "
            "pass params='NAME.irpa' to save its weights and the records beside it"
        )
    path = Path(path)
    if archive is not None:
        if params is None:
            raise ArtifactError(
                f"this module reads its weights from {archive}. Fix: pass params='NAME.irpa' to save a copy with it."
            )
        path.write_bytes(vmfb)
        for key, text in (records or {}).items():
            if read_record(archive, key) != text:
                raise ArtifactError(
                    f"this module was loaded from {archive}, whose record {key!r} is {read_record(archive, key)!r}, "
                    f"not {text!r}; a copy of that archive cannot say otherwise. Fix: compile it again to save it"
                )
        if Path(params).resolve() != archive.resolve():
            with replacing(params) as new:  # not into the file a module may map (`archive.replacing`)
                shutil.copyfile(archive, new)
        return None
    if params is not None:
        if parameters is None:
            raise ArtifactError(
                "only a program from torch.export (fx_rewrites.compile, or IreeBackend.compile of an "
                "ExportedProgram) can put its weights in a parameter archive; this one takes them as inputs or "
                "holds them itself. Fix: save without params="
            )
        extra = {
            key: torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) for key, text in (records or {}).items()
        }
        packed = pack(Path(params), extra) if pack is not None and parameters else None
        if packed is None:
            write_archive({**parameters, **extra}, params)
        path.write_bytes(vmfb if packed is None else packed)
        return packed
    if parameters:
        if embed is None:
            raise ArtifactError(
                "this module reads its weights as parameters and cannot put them inside. Fix: pass "
                "params='NAME.irpa' to save them beside it."
            )
        vmfb = embed()
    path.write_bytes(vmfb)
    return None


def read_record(archive: str | Path, key: str) -> str | None:
    """The record `key` saved into the parameter archive at `archive` (`save(records=)`); None if it has none."""
    from fx_rewrites.backends.iree.archive import read_entry

    data = read_entry(archive, key)
    return None if data is None else data.decode()
