"""State a module keeps outside its buffers, written in place: non-strict `torch.export` lifts the tensors a
plain Python object holds (transformers' `StaticCache` inside `TorchExportableModuleWithStaticCache`) as
constants, and writes them in place with no mutation in the signature (issue 26: the non-strict export of a
static-cache LM). `functionalize_inplace` makes each written constant a non-persistent buffer with a
BUFFER_MUTATION output, so `ep.module()` and the backends keep that state across calls as eager does."""

from __future__ import annotations

import pytest
import torch
from torch.export.graph_signature import InputKind, OutputKind

from fx_rewrites import testing as rt
from fx_rewrites.rules.inplace import MUTATING_OPS, RULES

Dim = torch.export.Dim
SIZE = 8


class Store:
    """Not a module: its tensors are neither parameters nor buffers (as transformers' cache layers)."""

    def __init__(self) -> None:
        self.keys = torch.zeros(1, SIZE, 4)
        self.length = torch.zeros((), dtype=torch.long)


class HeldCache(torch.nn.Module):
    """Writes `x` at positions `pos` of a cache held by a plain object, and reads the whole cache back."""

    def __init__(self) -> None:
        super().__init__()
        self.store = Store()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.store.length.copy_(pos[0])
        self.store.keys.index_copy_(1, pos, x * self.scale)
        self.store.length.add_(x.shape[1])
        return self.store.keys.cumsum(1) + self.store.length


def _export(dynamic: bool) -> torch.export.ExportedProgram:
    x, pos = torch.randn(1, 3, 4), torch.arange(3)
    shapes = {"x": {1: Dim("s", max=SIZE)}, "pos": {0: Dim("s", max=SIZE)}} if dynamic else None
    return torch.export.export(HeldCache(), (x, pos), dynamic_shapes=shapes, strict=False)


def calls(dynamic: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A prefill of 3 then (with a Dim) two steps of 1 token, or (static) two more of 3, the last from 0 again."""
    g = torch.Generator().manual_seed(0)
    lengths = (3, 1, 1) if dynamic else (3, 3, 3)
    out, at = [], 0
    for n in lengths:
        if at + n > SIZE:
            at = 0
        out.append((torch.randn(1, n, 4, generator=g), torch.arange(at, at + n)))
        at += n
    return out


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_written_constants_become_buffers_the_program_updates(dynamic):
    ep = _export(dynamic)
    constants = [s.target for s in ep.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR]
    assert len(constants) == 2  # the keys and the length: lifted constants, written in place
    assert not [s for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION]
    assert {torch.ops.aten.copy_.default, torch.ops.aten.index_copy_.default} <= set(rt.targets(ep))

    result = rt.apply_rules(ep, RULES)
    program = result.program
    assert not set(MUTATING_OPS) & set(rt.targets(program))
    written = {s.target for s in program.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    assert written == set(constants)
    specs = {s.target: s for s in program.graph_signature.input_specs}
    assert all(specs[t].kind == InputKind.BUFFER and specs[t].persistent is False for t in constants)

    module, eager = program.module(), HeldCache()
    eager.scale = HeldCache().scale
    for x, pos in calls(dynamic):
        torch.testing.assert_close(module(x, pos), eager(x, pos))
    state = dict(module.named_buffers())
    torch.testing.assert_close(sorted(state.values(), key=torch.Tensor.dim), [eager.store.length, eager.store.keys])
