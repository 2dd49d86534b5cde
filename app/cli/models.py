"""MODEL arguments: a factory in a .py file or a saved .pt2, and exporting it."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from fx_rewrites.app.cli.common import InputError, _one_line
from fx_rewrites.app.cli.inputs import _input_signature, _load_pt2, _random_inputs, _side, _torch_side_output
from fx_rewrites.app.compile import export_hint

_TORCH_DIR = os.path.dirname(torch.__file__)

# ----------------------------------------------------------------------------- loading a model


@attrs.define(eq=False)
class Model:
    """The model a command runs on: a factory's module, or a saved program."""

    label: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    #: where the inputs came from ("the factory", "inputs.pt", "random, seed 0")
    inputs_from: str = ""
    module: torch.nn.Module | None = None
    pt2: Path | None = None
    path: Path | None = None

    def program(self) -> torch.export.ExportedProgram:
        """A fresh ExportedProgram (each run gets its own: running one may update its buffers)."""
        if self.pt2 is not None:
            return _load_pt2(self.pt2)
        return _export(self)

    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A copy of the inputs (a run may write into them)."""
        return copy.deepcopy(self.args), copy.deepcopy(self.kwargs)


def _load_model(spec: str, inputs: str | None, *, need_inputs: bool = True) -> Model:
    """MODEL as given on the command line: PATH.py:FACTORY or PATH.pt2."""
    path_text, colon, factory = spec.rpartition(":")
    if colon and path_text.endswith(".py"):
        model = _load_factory(Path(path_text), factory, spec)
    elif spec.endswith(".py"):
        raise InputError(
            f"{spec} names a Python file but no factory in it. Fix: add the function that builds the model "
            f"after a colon, e.g. `{spec}:make_model`, where make_model() returns (module, example_args)."
        )
    elif spec.endswith(".pt2"):
        model = Model(label=spec, pt2=_existing(Path(spec), "the saved program"))
        if need_inputs and inputs is None:
            model.args, model.kwargs = _random_inputs(model.program())
            model.inputs_from = "random (seed 0; integer inputs in [0, 2), sizes from the program's hints)"
    else:
        raise InputError(
            f"cannot tell what {spec!r} is. Fix: give PATH.py:FACTORY (a function returning (module, "
            "example_args)) or PATH.pt2 (an ExportedProgram saved with torch.export.save)."
        )
    if inputs is not None:  # the positional inputs; a factory's keyword arguments stay
        model.args = _load_inputs(Path(inputs))
        model.kwargs = model.kwargs if model.module is not None else {}
        model.inputs_from = inputs
        if model.pt2 is not None:
            _check_input_count(model)
    return model


def _existing(path: Path, what: str) -> Path:
    if not path.exists():
        raise InputError(f"no such file: {path} ({what}; looked in {path.resolve().parent}). Fix: check the path.")
    if not path.is_file():
        raise InputError(f"{path} is not a file ({what}). Fix: give the path of the file itself.")
    return path


@contextlib.contextmanager
def _importable_from(directory: Path) -> Iterator[None]:
    """The model file's directory on sys.path, as `python model.py` would have it (sibling imports work)."""
    entry = str(directory.resolve())
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def _user_frame(e: BaseException, path: Path) -> str:
    """ "model.py:7 (`raise ValueError(...)`)": the innermost frame in the user's file, else outside torch."""
    frames = traceback.extract_tb(e.__traceback__)
    here = os.path.dirname(os.path.abspath(__file__))
    target = str(path.resolve())
    mine = [f for f in frames if os.path.abspath(f.filename) == target]
    mine = mine or [f for f in frames if not f.filename.startswith((_TORCH_DIR, here, "<"))]
    if not mine:
        return ""
    f = mine[-1]
    code = f" (`{f.line.strip()}`)" if f.line else ""
    return f" at {f.filename}:{f.lineno}{code}"


def _load_factory(path: Path, name: str, spec: str) -> Model:
    _existing(path, "the model's Python file")
    if not name.isidentifier():
        raise InputError(
            f"{name!r} after the colon in {spec!r} is not a Python name. Fix: write PATH.py:FACTORY, "
            "e.g. model.py:make_model."
        )
    module_name = f"_fx_rewrites_model_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise InputError(f"Python cannot load {path} as a module. Fix: give a .py source file.")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # classes defined in the file can be found by name (deepcopy, pickle)
    with _importable_from(path.parent):
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(module_name, None)
            raise InputError(
                f"importing {path} raised {type(e).__name__}: {_one_line(e)}{_user_frame(e, path)}. "
                f"Fix: make `python {path}` run without errors first.",
                cause=e,
            ) from e
        factory = getattr(module, name, None)
        if factory is None:
            functions = [
                k
                for k, v in vars(module).items()
                if inspect.isfunction(v) and v.__module__ == module_name and not k.startswith("_")
            ]
            known = f"; its functions are {', '.join(functions)}" if functions else "; it defines no functions"
            raise InputError(
                f"{path} has no {name!r}{known}. Fix: name the function that returns (module, example_args) "
                f"after the colon, e.g. {path}:{functions[0] if functions else 'make_model'}."
            )
        if not callable(factory):
            raise InputError(
                f"{spec} is a {type(factory).__name__}, not a function. Fix: point at a function that "
                "returns (module, example_args)."
            )
        try:
            made = factory()
        except Exception as e:
            raise InputError(
                f"the factory {spec} raised {type(e).__name__}: {_one_line(e)}{_user_frame(e, path)}. "
                f"Fix: the error is in {name}() or what it calls, not in fx-rewrites; make {name}() run on its "
                "own first.",
                cause=e,
            ) from e
    module_obj, args, kwargs = _check_factory_result(made, spec, name)
    return Model(label=spec, args=args, kwargs=kwargs, inputs_from="the factory", module=module_obj, path=path)


_FACTORY_SHAPE = (
    "return (module, example_args) or (module, example_args, example_kwargs), e.g. "
    '`return Net().eval(), (torch.randn(1, 3, 8, 8),)` or `return model, (ids,), {"use_cache": False}`'
)


def _check_factory_result(made: Any, spec: str, name: str) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        got = f"a tuple of {len(made)}" if isinstance(made, tuple) else f"a {type(made).__name__}"
        raise InputError(f"the factory {spec} returned {got}. Fix: {name}() must {_FACTORY_SHAPE}.")
    module, args, kwargs = (*made, {}) if len(made) == 2 else made
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InputError(
            f"the factory {spec} returned a {type(kwargs).__name__} as example_kwargs. Fix: the third element is "
            f'the dict of forward()\'s keyword arguments by name, e.g. {{"use_cache": False}}; {name}() must '
            f"{_FACTORY_SHAPE}."
        )
    if not isinstance(module, torch.nn.Module):
        raise InputError(
            f"the factory {spec} returned a {type(module).__name__} as the module. Fix: the first element must be "
            f"a torch.nn.Module; {name}() must {_FACTORY_SHAPE}."
        )
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple):
        raise InputError(
            f"the factory {spec} returned a {type(args).__name__} as example_args. Fix: example_args is the tuple "
            f"of forward()'s inputs; for one input write `(x,)`: {name}() must {_FACTORY_SHAPE}."
        )
    return module, args, dict(kwargs)


def _load_inputs(path: Path) -> tuple[Any, ...]:
    _existing(path, "--inputs")
    try:
        loaded = torch.load(path, weights_only=True)
    except Exception as e:
        raise InputError(
            f"--inputs {path} could not be loaded with torch.load(weights_only=True): {type(e).__name__}: "
            f"{_one_line(e)}. Fix: save a tuple of tensors (and numbers) with torch.save((x, y), path); "
            "fx-rewrites does not unpickle other objects.",
            detail=f"{type(e).__name__}: {e}",
            cause=e,
        ) from e
    if isinstance(loaded, list):
        loaded = tuple(loaded)
    if not isinstance(loaded, tuple):
        raise InputError(
            f"--inputs {path} holds a {type(loaded).__name__}, not a tuple of inputs. Fix: save the tuple of "
            "forward()'s inputs, e.g. torch.save((x,), path) for one input."
        )
    return loaded


# ----------------------------------------------------------------------------- export


def _export(model: Model) -> torch.export.ExportedProgram:
    assert model.module is not None
    args, kwargs = model.inputs()
    with _torch_side_output() as (records, stderr):
        try:
            return torch.export.export(copy.deepcopy(model.module), args, kwargs or None)
        except Exception as e:
            where = _user_frame(e, model.path) if model.path is not None else ""
            raise InputError(
                f"torch.export.export could not export the model from {model.label}: {type(e).__name__}: "
                f"{_one_line(e)}{where}. Fix: {export_hint(e, 'pass the saved .pt2')}. torch's error follows.",
                detail=f"{type(e).__name__}: {str(e).strip()}",
                cause=e,
                side=_side(records, stderr),
            ) from e


def _check_input_count(model: Model) -> None:
    program = model.program()
    wanted = program.call_spec.in_spec.num_leaves
    got = len(torch.utils._pytree.tree_leaves((model.args, model.kwargs)))
    if wanted != got:
        raise InputError(
            f"--inputs {model.inputs_from} holds {got} inputs; {model.label} takes {wanted} "
            f"({_input_signature(program)}). Fix: save one value per input, in forward()'s order."
        )


def _describe_inputs(model: Model) -> str:
    from fx_rewrites.explain import format_value

    leaves = torch.utils._pytree.tree_leaves((model.args, model.kwargs))
    return ", ".join(format_value(v) if isinstance(v, torch.Tensor) else repr(v) for v in leaves) or "none"


#: modules whose result depends on train/eval mode: random in training (dropout), or batch statistics
_MODE_DEPENDENT = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm, torch.nn.RReLU)


def train_mode_hint(model: Model) -> str:
    """Why results may differ from eager on every run, when the model was left in training mode (dropout draws
    new masks each call); "" otherwise. A factory's module is asked; a saved program's graph is read."""
    if model.module is not None:
        if not model.module.training:
            return ""
        found = [
            f"{type(m).__name__} at {name!r}"
            for name, m in model.module.named_modules()
            if m.training and isinstance(m, _MODE_DEPENDENT)
        ]
        listed = f" ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})" if found else ""
        return (
            f"the model is in training mode{listed}: dropout draws new random masks on every call (batch norm "
            "uses the batch's statistics), so no two runs agree. Fix: return module.eval() from the factory."
        )
    if model.pt2 is None:
        return ""
    aten = torch.ops.aten
    graph = model.program().graph
    dropouts = [
        n.name
        for n in graph.nodes
        if (n.target is aten.native_dropout.default and (len(n.args) < 3 or n.args[2] is not False))
        or (n.target is aten.dropout.default and len(n.args) > 2 and n.args[2] is True)
    ]
    if not dropouts:
        return ""
    return (
        f"the saved program was exported in training mode: its dropout ({', '.join(dropouts[:3])}) draws new "
        "random masks on every call, so no two runs agree. Fix: export the model after model.eval() and save it again."
    )
