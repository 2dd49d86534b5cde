"""Weights outside the module text: IREE parameters, served from memory or from an archive (.irpa).

Every ExportedProgram the backend imports has its parameters, buffers and
lifted constants of at least `inline_limit()` bytes bound to named
parameters instead of frozen into the MLIR as `torch.vtensor.literal` bytes
(the `FxImporterHooks.resolve_literal` hook of IREE 3.13's FX importer;
keys are the state-dict names):

    util.global private @__param_fc_weight = #stream.parameter.named<"model"::"fc.weight"> : tensor<8x64xf32>
    ...
    %w = util.global.load @__param_fc_weight : tensor<8x64xf32>
    %0 = torch_c.from_builtin_tensor %w : tensor<8x64xf32> -> !torch.vtensor<[8,64],f32>

The module text then holds no large weight bytes: the import, the cache key
and iree-compile's input stay small whatever the model's size. In-process,
`memory_parameters` serves the tensors from their own memory (an
`iree.runtime.ParameterIndex` whose buffers are the tensors' bytes, no
copy: with data tiling the module packs each weight once at load, else it
may read the tensor's memory as is);
`write_archive` writes them to an .irpa, which `iree-run-module
--parameters=model=model.irpa` or `load_parameters` reads. Smaller tensors
(and one-element and bool ones) stay inline, where IREE folds and packs them
at compile time, except float8 and bfloat16 ones (`NEVER_INLINE`);
`embed_parameters` puts the parameters back into the text, for a
self-contained .vmfb.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx_rewrites.backends.iree import archive
from fx_rewrites.backends.iree.element_types import element_type

#: the parameter scope the globals name (`--parameters=<scope>=file.irpa`)
SCOPE = "model"

#: environment variable: the size in bytes from which a weight is a parameter (default `INLINE_LIMIT`)
INLINE_ENV = "FX_REWRITES_IREE_INLINE_LIMIT"
#: weights smaller than this stay inline in the module. benchmarks/parameters.py found no speed difference
#: between all inline, all parameters, 64 KiB and 1 MiB on BERT, Llama, ViT and ResNet (docs/performance.md)
INLINE_LIMIT = 64 * 1024

_KEY = re.compile(r"[A-Za-z0-9_.:/-]+")


def inline_limit() -> int:
    """`$FX_REWRITES_IREE_INLINE_LIMIT` bytes, else `INLINE_LIMIT`."""
    text = os.environ.get(INLINE_ENV, "").strip()
    if not text:
        return INLINE_LIMIT
    try:
        limit = int(text)
    except ValueError:
        raise ValueError(f"{INLINE_ENV}={text!r}: expected a size in bytes (e.g. 65536)") from None
    if limit < 0:
        raise ValueError(f"{INLINE_ENV}={text!r}: expected a size in bytes >= 0")
    return limit


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


#: dtypes whose weights are parameters whatever their size, as IREE 3.13 compiles them only so (measured,
#: tests/backends/iree/test_narrow_float_weights.py): a float8 one inline over 256 bytes fails ("unhandled float
#: element bit width 8 for type 'tensor<16x24xf8E4M3FN>'"), a bfloat16 one of 8 or 64 elements too
#: ("'arith.constant' op failed to verify that all of {value, result} have same type"; 1024 compile)
NEVER_INLINE = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and ("float8" in str(d) or d == torch.bfloat16)
)


def is_parameter(tensor: torch.Tensor, limit: int) -> bool:
    """Whether a state tensor of this size becomes a parameter (else it is imported inline)."""
    if tensor.numel() <= 1 or tensor.dtype == torch.bool:
        return False
    return nbytes(tensor) >= limit or tensor.dtype in NEVER_INLINE


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` read the same bytes the same way (both alive, so the memory is one)."""
    layout = (a.dtype, a.shape, a.stride(), a.device) == (b.dtype, b.shape, b.stride(), b.device)
    return layout and a.data_ptr() == b.data_ptr()


def shared_names(programs: Mapping[str, ExportedProgram]) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    """id(tensor) -> key and key -> tensor over the state of several programs imported into one module.

    A tensor several programs hold (the same weight object) has one key, its name in the first program that
    holds it; a name two programs give different tensors (each its own lifted constant `c_0`) is kept by the
    first, and the next one's becomes `<function>/<name>`, so no function reads another's tensor. One name over
    the same memory in two programs (torchao's quantized weights: each export flattens them into new tensor
    objects over the subclass's data) is one key too."""
    names: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    for function, program in programs.items():
        for name, tensor in (*program.state_dict.items(), *program.constants.items()):
            if not isinstance(tensor, torch.Tensor) or not _KEY.fullmatch(name) or id(tensor) in names:
                continue
            held = tensors.get(name, tensor)
            key = name if held is tensor or _same_memory(held, tensor) else f"{function}/{name}"
            names[id(tensor)] = key
            tensors[key] = tensor
    return names, tensors


def parameter_hooks(
    iree: Any,
    program: ExportedProgram | Mapping[str, ExportedProgram],
    scope: str = SCOPE,
    limit: int = 0,
) -> Any:
    """FxImporterHooks that turn `program`'s state tensors of `limit` bytes or more into named parameters
    of `scope` (its `.tensors`, key -> tensor, holds the ones the module reads once the import is done).

    `program` may be several programs by function name, imported into one module with these hooks: a weight
    they share is one parameter global, read by each function (`shared_names`)."""
    fx_importer, ir = iree.compiler.extras.fx_importer, iree.compiler.ir
    names, by_key = shared_names(program if isinstance(program, Mapping) else {"main": program})

    class ParameterHooks(fx_importer.FxImporterHooks):
        def __init__(self) -> None:
            self.tensors: dict[str, torch.Tensor] = {}
            self._symbols: dict[str, str] = {}
            self._state: dict[str, tuple[str, str, torch.Tensor]] = {}
            self._module: Any = None

        def prepare_module(self, module_op: Any) -> None:
            self._module = module_op

        def resolve_literal(self, gni: Any, literal: Any, info: Any) -> Any:
            key = names.get(id(literal)) if isinstance(literal, torch.Tensor) else None
            if key is None or not is_parameter(literal, limit):
                return None  # inline, as the importer does by default (folded and packed at compile time)
            tensor_type = fx_importer.create_mlir_tensor_type(literal)
            if not (literal.dtype.is_floating_point or literal.dtype.is_complex):
                # builtin tensors are signless (torch_c.from_builtin_tensor gives the vtensor its si64)
                bits = ir.IntegerType.get_signless(literal.element_size() * 8)
                tensor_type = ir.RankedTensorType.get(list(literal.shape), bits)
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

        def state_global(self, key: str, tensor: torch.Tensor) -> tuple[str, str]:
            """Declare the mutable global holding the state tensor `key` (a buffer the program updates),
            initialised from the parameter `key` whatever its size (served, or archived, with the weights);
            its symbol and builtin tensor type.

            Never from an inline constant: IREE 3.13 gives two mutable globals of equal inline initial value
            (a key and a value cache, both zeros) one storage, so the writes to one land in the other
            (tests/backends/iree/test_equal_state.py; an initializer through `util.optimization_barrier` does
            not help: the constants are merged before). Parameters are loaded apart. Bool state stays inline."""
            tensor_type = _builtin_type(tensor)
            shared = self._state.get(key)
            if shared is not None:  # another function of the module reads this state: one global for all
                if shared[2] is not tensor:
                    raise ValueError(
                        f"two functions of one module name the state {key!r} with different tensors; give their "
                        "programs the same buffers (export them from one module instance)"
                    )
                return shared[0], shared[1]
            symbol = "__state_" + re.sub(r"\W", "_", key)
            while symbol in self._symbols.values():
                symbol += "_"
            if _KEY.fullmatch(key) and tensor.dtype != torch.bool:
                self.tensors[key] = tensor
                text = _copied_from_parameter(symbol, tensor_type, f'#stream.parameter.named<"{scope}"::"{key}">')
            else:
                text = f"util.global private mutable @{symbol} = {_dense(tensor)} : {tensor_type}"
            body = self._module.regions[0].blocks[0]
            first = body.operations[0] if len(body.operations) else None
            at = ir.InsertionPoint(first) if first is not None else ir.InsertionPoint(body)
            scratch = ir.Module.parse(text, context=self._module.context)  # alive while its ops move
            for op in list(scratch.body.operations):
                op.detach_from_parent()
                at.insert(op)
            self._symbols["\0state:" + key] = symbol
            self._state[key] = (symbol, tensor_type, tensor)
            return symbol, tensor_type

        def _literal(self, key: str) -> torch.Tensor:
            return by_key[key]

    return ParameterHooks()


def _copied_from_parameter(symbol: str, tensor_type: str, parameter: str) -> str:
    """A mutable global `symbol` that starts as a copy of `parameter`, read through an immutable global.

    Declared `= #stream.parameter.named<...>` itself, the global's storage can be the parameter's memory as
    is: a read-only mapping of the .irpa once saved and loaded, where the first in-place write (a cache's
    index_copy_) is a segmentation fault. The immutable global is a constant: the store makes a copy.
    """
    return (
        f"util.global private @{symbol}__initial = {parameter} : {tensor_type}\n"
        f"util.global private mutable @{symbol} : {tensor_type}\n"
        "util.initializer {\n"
        f"  %initial = util.global.load @{symbol}__initial : {tensor_type}\n"
        f"  %copy = flow.tensor.clone %initial : {tensor_type}\n"
        f"  util.global.store %copy, @{symbol} : {tensor_type}\n"
        "  util.return\n"
        "}"
    )


def attribute_tensors(gm: GraphModule) -> dict[str, torch.Tensor]:
    """The tensors `gm` reads with get_attr, by target (frozen weights, `backends/freezing.py`'s
    `_frozen_<k>`; a make_fx graph's `_tensor_constant<k>`)."""
    tensors: dict[str, torch.Tensor] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        if isinstance(value, torch.Tensor):
            tensors[str(node.target)] = value
    return tensors


def attribute_hooks(iree: Any, gm: GraphModule, scope: str = SCOPE, limit: int = 0) -> Any:
    """`parameter_hooks` for a GraphModule: the tensors it reads with get_attr of `limit` bytes or more
    become named parameters (keys: the get_attr targets), the others stay inline. The torch.compile route's
    frozen weights (`backends/freezing.py`) are get_attrs, which `preparing.prepare_graph_module`'s import
    hands to `resolve_literal` as the tensors themselves, so the hooks know them by id."""
    # parameter_hooks reads a program's state_dict and constants only
    view = SimpleNamespace(state_dict=attribute_tensors(gm), constants={})
    return parameter_hooks(iree, view, scope, limit)  # type: ignore[arg-type]


def _builtin_type(tensor: torch.Tensor) -> str:
    """The builtin (signless) tensor type holding `tensor`: `tensor<4x8xf32>`, `tensor<i64>`."""
    element = element_type(tensor.dtype, signless=True)
    if element is None:
        raise NotImplementedError(f"a mutated buffer of dtype {tensor.dtype} cannot be a module global yet")
    return f"tensor<{''.join(f'{d}x' for d in tensor.shape)}{element}>"


def _dense(tensor: torch.Tensor) -> str:
    """`tensor`'s value as an MLIR dense attribute: raw little-endian bytes in hex (bools as a list)."""
    if tensor.dtype == torch.bool:
        return "dense<" + str(tensor.tolist()).replace("True", "true").replace("False", "false") + ">"
    return f'dense<"0x{_bytes(tensor).tobytes().hex().upper()}">'


def _bytes(tensor: torch.Tensor) -> Any:
    """`tensor`'s bytes as a flat uint8 numpy array: its own memory when it is a contiguous CPU tensor."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def memory_parameters(config: Any, tensors: Mapping[str, torch.Tensor], scope: str = SCOPE) -> Any:
    """The `io_parameters` VM module that serves `tensors` under `scope` from their memory (no copy for a
    contiguous CPU tensor). The runtime may import that memory as is (measured without data tiling: an
    in-place change to the tensor then reaches the module) or pack a copy while the module initialises."""
    import iree.runtime

    index = iree.runtime.ParameterIndex()
    for key, tensor in tensors.items():
        index.add_buffer(key, _bytes(tensor))
    return iree.runtime.create_io_parameters_module(config.vm_instance, index.create_provider(scope=scope))


def write_archive(tensors: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """An .irpa holding `tensors` (raw bytes, any dtype) under their keys, as IREE's `create_archive_file`
    writes it, each tensor written from its own memory (`archive.write`: no copy in the process)."""
    archive.write({key: _bytes(tensor) for key, tensor in tensors.items()}, path)


def load_parameters(config: Any, path: str | Path, scope: str = SCOPE) -> Any:
    """The `io_parameters` VM module that serves `path`'s parameters under `scope`, from a read-only mapping
    of the file: its pages are read when the module reads them, shared with the page cache, never copied
    into the process (a module that reads its weights in place, `encoding.py`, costs their size once)."""
    import iree.runtime

    index = iree.runtime.ParameterIndex()
    index.load(str(path), mmap=True)
    return iree.runtime.create_io_parameters_module(config.vm_instance, index.create_provider(scope=scope))


_GLOBAL = re.compile(
    r"(util\.global private (?:mutable )?@(?P<symbol>\w+) = )"
    r'#stream\.parameter\.named<"(?P<scope>[^"]*)"::"(?P<key>[^"]*)">'
)


def embed_parameters(mlir: str, tensors: Mapping[str, torch.Tensor], scope: str = SCOPE) -> str:
    """`mlir` (an import with parameters) with each parameter of `scope` inline again: the global's
    initial value is a `dense_resource` blob holding the tensor's bytes (a self-contained module)."""
    blobs: list[str] = []

    def inline(m: re.Match[str]) -> str:
        if m["scope"] != scope or m["key"] not in tensors:
            return m[0]
        tensor = tensors[m["key"]]
        name = f"fx_param_{m['symbol']}"
        alignment = max(tensor.element_size(), 1).to_bytes(4, "little").hex().upper()
        blobs.append(f'      {name}: "0x{alignment}{_bytes(tensor).tobytes().hex().upper()}"')
        return f"{m[1]}dense_resource<{name}>"

    text = _GLOBAL.sub(inline, mlir)
    if not blobs:
        return text
    entries = ",\n".join(blobs)
    head = "dialect_resources: {\n    builtin: {\n"
    if "{-#" in text and head in text:
        return text.replace(head, head + entries + ",\n", 1)
    return f"{text}\n{{-#\n  dialect_resources: {{\n    builtin: {{\n{entries}\n    }}\n  }}\n#-}}\n"
