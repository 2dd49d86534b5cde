"""Memory: weights as parameters (not MLIR text), the estimate before a step, and a compiler killed for memory."""

from __future__ import annotations

import pytest
import torch

from fx_rewrites.backends.iree import CompileCache, IreeBackend, IreeCompileError, IreeMemoryError, memory
from fx_rewrites.backends.iree.importing import iree_modules
from fx_rewrites.backends.iree.parameters import INLINE_ENV
from tests.backends.models import WeightSizes


def _compile():
    torch.manual_seed(0)
    model, x = WeightSizes().eval(), torch.randn(3, 256)
    return model, x, IreeBackend(cache=CompileCache()).compile(torch.export.export(model, (x,)), (x,))


def test_large_weights_are_parameters_and_the_text_holds_none_of_their_bytes():
    model, x, compiled = _compile()
    assert set(compiled.parameters) == {"big.weight"}
    assert compiled.parameters["big.weight"] is not None
    assert '#stream.parameter.named<"model"::"big.weight">' in compiled.mlir
    assert len(compiled.mlir) < 64 * 1024  # 256 KiB of weight would be 512 KiB of hex
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_the_inline_limit_is_a_setting(monkeypatch):
    monkeypatch.setenv(INLINE_ENV, str(1 << 30))
    _, _, everything_inline = _compile()
    assert not everything_inline.parameters and "stream.parameter" not in everything_inline.mlir
    monkeypatch.setenv(INLINE_ENV, "0")
    _, _, everything_a_parameter = _compile()
    assert set(everything_a_parameter.parameters) == {"big.weight", "big.bias", "small.weight", "small.bias", "scale"}
    monkeypatch.setenv(INLINE_ENV, "lots")
    with pytest.raises(ValueError, match="expected a size in bytes"):
        _compile()


def test_a_step_that_would_not_fit_is_refused_before_it_starts(monkeypatch):
    monkeypatch.setattr(memory, "available", lambda: 100 << 20)  # 100 MB left
    with pytest.raises(IreeMemoryError) as info:
        _compile()
    e = info.value
    assert e.step == "the import and iree-compile" and e.available == 100 << 20 and e.needed > e.available
    assert "would need about 0.3 GB" in str(e) and "Fix:" in str(e) and INLINE_ENV in str(e)
    monkeypatch.setenv(memory.CHECK_ENV, "0")  # the check can be turned off
    _compile()


def test_a_compiler_killed_by_sigkill_is_named_a_memory_error(monkeypatch):
    core = iree_modules().compiler.tools.core
    monkeypatch.setattr(core, "build_compile_command_line", lambda *a, **k: ["sh", "-c", "kill -9 $$"])
    x = torch.randn(3)
    with pytest.raises(IreeMemoryError) as info:
        IreeBackend(cache=CompileCache()).artifact(torch.export.export(torch.nn.Tanh(), (x,)))
    assert not isinstance(info.value, IreeCompileError)  # so no second try without performance flags
    assert info.value.step == "iree-compile" and "OOM killer" in str(info.value) and "Fix:" in str(info.value)


def test_available_reads_meminfo_and_the_cgroup(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 8 << 30)
    monkeypatch.setattr(memory, "_cgroup_available", lambda: 2 << 30)
    assert memory.available() == 2 << 30
    monkeypatch.setattr(memory, "_cgroup_available", lambda: None)
    assert memory.available() == 8 << 30
    monkeypatch.setattr(memory, "_meminfo_available", lambda: None)
    assert memory.available() is None
    memory.check("x", "y", 1 << 60, "z")  # nothing known: no refusal


def test_integer_buffers_are_parameters_too(monkeypatch):
    class Positions(torch.nn.Module):  # BERT's position_ids: an int64 buffer, sliced
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("ids", torch.arange(512).unsqueeze(0), persistent=False)
            self.register_buffer("small", torch.arange(16, dtype=torch.int32))
            self.table = torch.nn.Embedding(512, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.table(self.ids[:, : x.shape[1]]) + x[..., None] + self.small[:8].float()

    monkeypatch.setenv(INLINE_ENV, "0")
    model, x = Positions().eval(), torch.randn(2, 7)
    compiled = IreeBackend(cache=CompileCache()).compile(torch.export.export(model, (x,)), (x,))
    assert {"ids", "small", "table.weight"} <= set(compiled.parameters)
    assert "tensor<1x512xi64>" in compiled.mlir and "tensor<16xi32>" in compiled.mlir  # signless builtin types
    torch.testing.assert_close(compiled(x), model(x))
