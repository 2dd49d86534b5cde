"""The torch.compile route at real size: frozen weights over the inline limit are IREE parameters, not MLIR literals.

A frozen weight (`backends/freezing.py`) is a get_attr of the inference graph; `parameters.attribute_hooks` binds
the ones of `parameters.inline_limit()` bytes or more as named parameters served from the tensors' memory, as
the export route does for an ExportedProgram's state (issue 25: a 1B decoder's weights as literals are 7.6 GB
of text).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from fx_rewrites.backends.dynamo import CompiledGraph, dynamo_backend
from fx_rewrites.backends.iree import IreeBackend, memory
from fx_rewrites.backends.iree.cache import CompileCache
from fx_rewrites.backends.iree.parameters import INLINE_ENV
from tests.backends.models import WeightSizes


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(shapes: list[tuple[int, ...]], dynamic: bool = False) -> tuple[WeightSizes, list[CompiledGraph]]:
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = WeightSizes().eval()
    backend = dynamo_backend(IreeBackend(cache=CompileCache()), on_graph=graphs.append, strict=True)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(shape)
            expected = x.double() @ model.big.weight.double().T + model.big.bias.double()
            expected = torch.relu(expected) * 0.5 @ model.small.weight.double().T + model.small.bias.double()
            torch.testing.assert_close(compiled(x), expected.float(), rtol=1e-4, atol=1e-5)
    return model, graphs


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_frozen_weights_over_the_limit_are_parameters(dynamic):
    model, graphs = _run([(3, 256), (5, 256)] if dynamic else [(3, 256)], dynamic)
    (graph,) = graphs
    assert graph.kind == "inference" and len(graph.frozen) == 5
    compiled = graph.compiled
    # the big weight is a parameter served from the model's own tensor; the rest stays inline
    ((key, tensor),) = compiled.parameters.items()
    assert tensor is model.big.weight or tensor.data_ptr() == model.big.weight.data_ptr()
    assert f'#stream.parameter.named<"model"::"{key}"> : tensor<256x256xf32>' in compiled.mlir
    assert len(compiled.mlir) < 64 * 1024  # 256 KiB of weight would be 512 KiB of hex
    assert compiled.mlir.count("torch.vtensor.literal") >= 3  # the small weight, both biases, the scale


def test_the_inline_limit_applies_to_frozen_weights(monkeypatch):
    monkeypatch.setenv(INLINE_ENV, str(1 << 30))
    _, (graph,) = _run([(3, 256)])
    assert not graph.compiled.parameters and "stream.parameter" not in graph.compiled.mlir
    torch._dynamo.reset()
    monkeypatch.setenv(INLINE_ENV, "0")
    _, (graph,) = _run([(3, 256)])
    assert len(graph.compiled.parameters) == 5 and "torch.vtensor.literal" not in graph.compiled.mlir


def test_the_memory_check_counts_only_inline_frozen_weights(monkeypatch):
    # room for 6x 100 KB of inline weights besides the compiler: the ~7 KB left inline fit, the 270 KB do not
    monkeypatch.setattr(memory, "available", lambda: 300 << 20)
    monkeypatch.setattr(memory, "COMPILER_BASE", (300 << 20) - 6 * 100_000)
    _run([(3, 256)])
    torch._dynamo.reset()
    monkeypatch.setenv(INLINE_ENV, str(1 << 30))
    with pytest.raises(
        BackendCompilerFailed, match=r"IreeMemoryError: the import and iree-compile of a module with 0 MB"
    ):
        _run([(3, 256)])


def test_a_changed_parameter_weight_compiles_again():
    """A frozen weight served as a parameter from the model's memory, changed in place: the next call warns,
    compiles again and matches (the compiled module is the same, from the cache; the parameter is the new value)."""
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = WeightSizes().eval()
    compiled = torch.compile(model, backend=dynamo_backend(IreeBackend(), on_graph=graphs.append, strict=True))
    x = torch.randn(3, 256)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        model.big.weight.mul_(-2)
        with pytest.warns(UserWarning, match=r"frozen parameter.*changed.*compiling it again"):
            got = compiled(x)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
    assert len(graphs) == 1
