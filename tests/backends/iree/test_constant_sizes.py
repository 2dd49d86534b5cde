"""A size torch proved constant but kept as a SymInt must reach IREE as an int (issue 26, Mamba2's prefill).

Under a Dim that is a multiple of a chunk (`L = 16 * chunks`), `x.reshape(b, -1, 16, ...)` gets the value
shape `(b, chunks, 16, ...)` with its 16 a SymInt. IREE's importer typed it `?`: a view with two dynamic
dims, which IREE 3.13 lowers with a negative size (a compile failure) or, inside Mamba2's chunked scan,
into an empty result and logits 5.1 off with no error (`backends/iree/constant_sizes.py`).
"""

from __future__ import annotations

import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites.backends.iree.constant_sizes import concrete_sizes
from fx_rewrites.program import copy_graph_module
from tests.lm_models import Mamba2Scan

CHUNK = 16


def _chunks() -> Dim:
    return Dim("chunks", min=1, max=4)


class Chunked(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.reshape(2, -1, CHUNK, 4, 8) * 2).cumsum(2)


def _export(module: torch.nn.Module, *args: torch.Tensor) -> torch.export.ExportedProgram:
    shapes = tuple({1: CHUNK * _chunks()} for _ in args)
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=shapes)


def test_the_export_keeps_a_constant_symint_and_the_copy_gets_the_int():
    program = _export(Chunked(), torch.randn(2, 32, 4, 8))
    reshape = next(n for n in program.graph.nodes if n.target is torch.ops.aten.reshape.default)
    size = reshape.meta["val"].shape[2]
    assert isinstance(size, torch.SymInt) and size == CHUNK, "torch now gives an int: this module may go"

    copy = copy_graph_module(program.graph_module)
    assert concrete_sizes(copy.graph) >= 1
    node = next(n for n in copy.graph.nodes if n.name == reshape.name)
    shape = node.meta["val"].shape
    assert type(shape[2]) is int and shape[2] == CHUNK
    assert isinstance(shape[1], torch.SymInt)  # the real dynamic dim stays symbolic
    assert isinstance(reshape.meta["val"].shape[2], torch.SymInt)  # the program itself is left as it was


def test_chunked_reshape_through_iree():
    """It failed to compile ("invalid Read access range [0 to -8192]") before."""
    compiled = fx_rewrites.compile(_export(Chunked(), torch.randn(2, 32, 4, 8)))
    for length in (16, 48, 64):
        x = torch.randn(2, length, 4, 8)
        torch.testing.assert_close(compiled(x), Chunked()(x), rtol=0, atol=1e-5)


def test_mamba2_chunk_scan_through_iree():
    """transformers' Mamba2 chunked scan: IREE returned an empty output (and the model wrong logits) before."""
    generator = torch.Generator().manual_seed(0)
    scan = Mamba2Scan(CHUNK, generator)

    def inputs(length: int) -> tuple[torch.Tensor, ...]:
        return Mamba2Scan.inputs(length, generator)

    compiled = fx_rewrites.compile(_export(scan, *inputs(32)))
    for length in (32, 48):
        args = inputs(length)
        for got, expected in zip(compiled(*args), scan(*args), strict=True):
            assert got.shape == expected.shape
            # torch's own float32 error on such inputs, against float64: 3.3e-6 to 5.7e-6 (values up to 78)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
