"""Saved programs and input files: safe .pt2 loading, random example inputs."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import traceback
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fx_rewrites.app.cli.common import (
    InputError,
)

# ----------------------------------------------------------------------------- .pt2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        out = []
        for r in self.records:
            out.append(f"{r.levelname} {r.name}: {r.getMessage()}")
            if r.exc_info and r.exc_info[1] is not None:
                out.append("".join(traceback.format_exception(*r.exc_info)).rstrip())
        return "\n".join(out)

    def errors(self) -> list[str]:
        """The exceptions logged, one line each ("RuntimeError: PytorchStreamReader failed ...")."""
        return [
            f"{type(r.exc_info[1]).__name__}: {str(r.exc_info[1]).strip().splitlines()[0]}"
            for r in self.records
            if r.exc_info and r.exc_info[1] is not None and str(r.exc_info[1]).strip()
        ]


@contextlib.contextmanager
def _torch_side_output() -> Iterator[tuple[_Records, io.StringIO]]:
    """What torch logs or prints to stderr meanwhile (a traceback logged as a
    warning by torch.export.load, the partial graph export prints on failure),
    kept for --verbose instead of interleaved with our message."""
    records, stderr = _Records(), io.StringIO()
    # torch._logging gives "torch" and several of its children (torch.export, torch._dynamo, ...)
    # their own stderr handlers and propagate=False: swap each one's handlers for ours
    loggers = [logging.getLogger("torch")] + [
        logger
        for name, logger in list(logging.root.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(logger, logging.Logger) and logger.handlers
    ]
    saved = [(logger, logger.handlers[:]) for logger in loggers]
    for logger in loggers:
        logger.handlers = [records]
    try:
        with contextlib.redirect_stderr(stderr):
            yield records, stderr
    finally:
        for logger, handlers in saved:
            logger.handlers = handlers


def _side(records: _Records, stderr: io.StringIO) -> str:
    return "\n".join(t for t in (stderr.getvalue().strip(), records.text()) if t)


#: the archive entries torch.export.load (2.13) unpickles: torch.load(weights_only=False) for tensors the
#: configs mark use_pickle, pickle.loads / torch._C._pickle_load_obj for custom and opaque objects, and a
#: weights_only=False fallback for .pt entries (sample inputs, legacy constants) weights_only cannot read.
_PICKLED_PREFIXES = ("custom_obj_", "opaque_obj_")


def _pickled_entries(path: Path) -> list[str]:
    """Entries of the archive that torch.export.load would unpickle. Raises
    zipfile.BadZipFile (and friends) for a file that is no readable zip."""
    found = []
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            inner = name.split("/", 1)[-1]  # entries sit under the archive's root folder
            if inner.startswith(("data/weights/", "data/constants/")) and inner.endswith("_config.json"):
                try:
                    config = json.loads(archive.read(name)).get("config", {})
                    items = list(config.items())
                except (ValueError, AttributeError):
                    found.append(f"{name} (not valid JSON)")
                    continue
                for fqn, meta in items:
                    file = str(meta.get("path_name", "")) if isinstance(meta, dict) else ""
                    if not isinstance(meta, dict) or meta.get("use_pickle") or file.startswith(_PICKLED_PREFIXES):
                        found.append(f"{fqn} ({file or 'unknown payload'})")
            elif inner.endswith(".pt"):
                try:
                    torch.load(io.BytesIO(archive.read(name)), weights_only=True)
                except Exception:
                    found.append(name)
    return found


#: how torch.save's legacy (non-zip) format starts: its magic number, pickled with protocol 2
_LEGACY_TORCH_SAVE = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."


def _torch_save_kind(path: Path, head: bytes) -> str:
    """What a file torch.save wrote is ("a torch.save checkpoint ..."), or "" for anything else. Read from
    the zip's entry names or the first bytes only: nothing is unpickled."""
    if head.startswith(_LEGACY_TORCH_SAVE):
        return "a torch.save checkpoint in its legacy pickle format (a state dict or a pickled module)"
    if head[:1] == b"\x80":
        return "a Python pickle (pickle.dump, or an old torch.save)"
    try:
        with zipfile.ZipFile(path) as archive:
            inner = {name.split("/", 1)[-1] for name in archive.namelist()}
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError):
        return ""
    exported = "archive_format" in inner or any(n.startswith("models/") for n in inner)
    return (
        "a torch.save checkpoint (its data.pkl holds a state dict or a pickled module)"
        if "data.pkl" in inner and not exported
        else ""
    )


def _load_pt2(path: Path) -> torch.export.ExportedProgram:
    """torch.export.load, and only that, after checking it will unpickle nothing."""
    with path.open("rb") as f:
        head = f.read(len(_LEGACY_TORCH_SAVE))
    kind = _torch_save_kind(path, head)
    if kind:
        raise InputError(
            f"{path} is {kind}, not an ExportedProgram: a .pt2 here is what "
            "torch.export.save writes. Fix: export the model and save that, "
            "`torch.export.save(torch.export.export(model.eval(), example_args), 'model.pt2')`, or pass "
            "PATH.py:FACTORY, where FACTORY() builds the model, loads these weights "
            "(model.load_state_dict(torch.load(path))) and returns (module, example_args)."
        )
    try:
        pickled = _pickled_entries(path)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError):
        pickled = []  # not a readable zip: torch.export.load fails before it unpickles anything; it says why
    if pickled:
        raise InputError(
            f"{path} holds entries torch.export.load would unpickle: {', '.join(pickled[:5])}"
            f"{' and more' if len(pickled) > 5 else ''}. Unpickling can run arbitrary code, so fx-rewrites "
            "does not load it. Fix: save the program from plain tensors (no tensor subclasses or custom objects), "
            "or pass the model as PATH.py:FACTORY."
        )
    with _torch_side_output() as (records, stderr):
        try:
            program = torch.export.load(str(path))
        except Exception as e:
            if head[:2] == b"PK":
                what = (
                    "starts like a .pt2 (zip) archive but cannot be read to the end: it is truncated or damaged "
                    "(an interrupted copy or download?)"
                )
            elif len(head) == 0:
                what = "is empty"
            else:
                what = "is not a .pt2 archive (it does not start like the zip file torch.export.save writes)"
            raise InputError(
                f"{path} {what}. Fix: save the program again with torch.export.save(ep, path) and copy the "
                "whole file. torch.export.load's errors follow.",
                detail="\n".join([*records.errors(), f"{type(e).__name__}: {e}"]),
                cause=e,
                side=_side(records, stderr),
            ) from e
    if not isinstance(program, torch.export.ExportedProgram):
        raise InputError(
            f"{path} holds a {type(program).__name__}, not an ExportedProgram. Fix: save with torch.export.save."
        )
    return program


def _hint_size(d: Any, program: torch.export.ExportedProgram) -> int:
    """A concrete size for a dimension: itself, or a symbolic dim's hint (else its least allowed size, 2 or more)."""
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    if hint is not None:
        return int(hint)
    bounds = program.range_constraints.get(d.node.expr)
    low = int(bounds.lower) if bounds is not None else 2
    high = int(bounds.upper) if bounds is not None and bounds.upper.is_finite else max(low, 2)
    return min(max(low, 2), high)


def _random_value(val: Any, program: torch.export.ExportedProgram) -> Any:
    if isinstance(val, torch.Tensor):
        shape = [_hint_size(d, program) for d in val.shape]
        if val.dtype == torch.bool:
            return torch.randint(0, 2, shape).bool()
        if val.dtype.is_floating_point or val.dtype.is_complex:
            return torch.randn(shape, dtype=torch.float32 if val.dtype.is_floating_point else val.dtype).to(val.dtype)
        return torch.randint(0, 2, shape, dtype=val.dtype)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return type(val.node.hint)(val.node.hint) if val.node.hint is not None else _hint_size(val, program)
    return val


def _random_inputs(program: torch.export.ExportedProgram) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Random inputs fitting the program's user inputs (placeholder meta vals; symbolic sizes at their hints)."""
    from torch.export.graph_signature import ConstantArgument, InputKind

    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    torch.manual_seed(0)
    flat = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        if isinstance(spec.arg, ConstantArgument):
            flat.append(spec.arg.value)
            continue
        flat.append(_random_value(placeholders[spec.arg.name].meta.get("val"), program))
    args, kwargs = torch.utils._pytree.tree_unflatten(flat, program.call_spec.in_spec)
    return tuple(args), dict(kwargs)


def _input_signature(program: torch.export.ExportedProgram) -> str:
    from fx_rewrites.explain import format_value

    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    return ", ".join(
        f"{name} {format_value(nodes[name].meta.get('val')) if name in nodes else ''}".strip()
        for name in program.graph_signature.user_inputs
    )
