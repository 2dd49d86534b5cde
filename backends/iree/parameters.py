"""Weights outside the module: an IREE parameter archive (.irpa) and the globals that read it.

By default the importer freezes every parameter, buffer and lifted constant
into the module as a `torch.vtensor.literal` (the weights travel inside the
.vmfb). `ParameterHooks` makes it emit, for each such tensor of more than
one element, a global bound to a named parameter instead:

    util.global private @__param_fc_weight = #stream.parameter.named<"model"::"fc.weight"> : tensor<8x64xf32>
    ...
    %w = util.global.load @__param_fc_weight : tensor<8x64xf32>
    %0 = torch_c.from_builtin_tensor %w : tensor<8x64xf32> -> !torch.vtensor<[8,64],f32>

(the `FxImporterHooks.resolve_literal` hook of IREE 3.13's FX importer;
keys are the state-dict names). `write_archive` writes those tensors to an
.irpa, which the runtime reads through an `io_parameters` module
(`iree-run-module --parameters=model=model.irpa`, or `load_parameters`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

#: the parameter scope the globals name (`--parameters=<scope>=file.irpa`)
SCOPE = "model"

_KEY = re.compile(r"[A-Za-z0-9_.:/-]+")


def state_names(program: ExportedProgram) -> dict[int, str]:
    """id(tensor) -> its name, for the program's parameters, buffers and lifted constants."""
    names: dict[int, str] = {}
    for name, tensor in (*program.state_dict.items(), *program.constants.items()):
        if isinstance(tensor, torch.Tensor) and _KEY.fullmatch(name):
            names.setdefault(id(tensor), name)
    return names


def parameter_hooks(iree: Any, program: ExportedProgram, scope: str = SCOPE) -> Any:
    """FxImporterHooks that turn `program`'s state tensors into named parameters of `scope`
    (its `.tensors`, key -> tensor, holds the ones the module reads once the import is done)."""
    fx_importer, ir = iree.compiler.extras.fx_importer, iree.compiler.ir
    names = state_names(program)

    class ParameterHooks(fx_importer.FxImporterHooks):
        def __init__(self) -> None:
            self.tensors: dict[str, torch.Tensor] = {}
            self._symbols: dict[str, str] = {}
            self._module: Any = None

        def prepare_module(self, module_op: Any) -> None:
            self._module = module_op

        def resolve_literal(self, gni: Any, literal: Any, info: Any) -> Any:
            key = names.get(id(literal)) if isinstance(literal, torch.Tensor) else None
            if key is None or literal.numel() <= 1:
                return None  # inline, as the importer does by default (a one-element tensor folds better)
            tensor_type = fx_importer.create_mlir_tensor_type(literal)
            symbol = self._symbols.get(key)
            if symbol is None:
                symbol = self._declare(key, tensor_type)
            loaded = ir.Operation.create(
                "util.global.load", results=[tensor_type], attributes={"global": ir.FlatSymbolRefAttr.get(symbol)}
            ).result
            vtensor_type = gni._cc.tensor_to_vtensor_type(literal)
            return ir.Operation.create("torch_c.from_builtin_tensor", results=[vtensor_type], operands=[loaded]).result

        def _declare(self, key: str, tensor_type: Any) -> str:
            symbol = "__param_" + re.sub(r"\W", "_", key)
            while symbol in self._symbols.values():
                symbol += "_"
            body = self._module.regions[0].blocks[0]
            op = ir.Operation.parse(
                f'util.global private @{symbol} = #stream.parameter.named<"{scope}"::"{key}"> : {tensor_type}',
                context=self._module.context,
            )
            first = body.operations[0] if len(body.operations) else None
            (ir.InsertionPoint(first) if first is not None else ir.InsertionPoint(body)).insert(op)
            self._symbols[key] = symbol
            self.tensors[key] = self._literal(key)
            return symbol

        def _literal(self, key: str) -> torch.Tensor:
            return program.state_dict[key] if key in program.state_dict else program.constants[key]

    return ParameterHooks()


def write_archive(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """An .irpa holding `tensors` (raw bytes, any dtype) under their keys."""
    import iree.runtime

    index = iree.runtime.ParameterIndex()
    for key, tensor in tensors.items():
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        index.add_buffer(key, data)
    index.create_archive_file(str(path))


def load_parameters(config: Any, path: str | Path, scope: str = SCOPE) -> Any:
    """The `io_parameters` VM module that serves `path`'s parameters under `scope`."""
    import iree.runtime

    index = iree.runtime.ParameterIndex()
    index.load(str(path))
    return iree.runtime.create_io_parameters_module(config.vm_instance, index.create_provider(scope=scope))
