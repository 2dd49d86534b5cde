"""The compile cache's key on real compiles: two programs share a key only where the compiled module is the same.

Two ranks of a tensor-parallel layer hold shards of the same shapes with other values. Weights of at least
`parameters.inline_limit()` bytes are parameters: the module names them and reads their values from the archive
it is given, so the two shards' programs are one module (one key, one compile, byte-identical files) that computes
each rank's own numbers. Weights under the limit are inside the module: other values, another module and key.
"""

from __future__ import annotations

import pytest
import torch

from fx_rewrites.backends.iree import CompileCache, IreeBackend
from fx_rewrites.backends.iree.parameters import inline_limit


class Shard(torch.nn.Module):
    """One rank's rows of a column-parallel linear layer (seeded: each rank's shard its own values)."""

    def __init__(self, rows: int, seed: int, activation=torch.relu) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(rows, 64, generator=g) / 8)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(torch.nn.functional.linear(x, self.weight))


def _compile(shard: Shard, x: torch.Tensor, directory):
    ep = torch.export.export(shard.eval(), (x,))
    return IreeBackend(cache=CompileCache(directory=directory)).compile(ep, (x,))


def _holds(vmfb: bytes, weight: torch.Tensor) -> bool:
    """Whether `vmfb` holds 4 consecutive values of `weight` along either dimension (float32 bytes): IREE stores
    an inline matmul weight packed in tiles of its columns (the test below finds each one of them)."""
    for matrix in (weight.detach(), weight.detach().T):
        for row in matrix.contiguous().numpy():
            if any(row[i : i + 4].tobytes() in vmfb for i in range(0, row.size - 3, 4)):
                return True
    return False


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(3, 64, generator=torch.Generator().manual_seed(2))


def test_shards_held_as_parameters_share_one_key_and_one_module(x, tmp_path):
    rank0, rank1 = Shard(512, seed=0), Shard(512, seed=1)  # 128 KiB each: parameters
    assert rank0.weight.nbytes >= inline_limit() and not torch.equal(rank0.weight, rank1.weight)
    first = _compile(rank0, x, tmp_path / "shared")
    second = _compile(rank1, x, tmp_path / "shared")  # another process over the same cache directory
    assert second.key == first.key and second.from_cache and second.vmfb == first.vmfb
    # the module is what rank 1 compiling alone would get: byte for byte (the key shared nothing it should not)
    alone = _compile(rank1, x, tmp_path / "alone")
    assert not alone.from_cache and alone.key == first.key and alone.vmfb == first.vmfb
    # neither rank's weights are in it: each compiled program reads its own from its parameters
    assert not _holds(first.vmfb, rank0.weight) and not _holds(first.vmfb, rank1.weight)
    assert set(first.parameters) == set(second.parameters) == {"weight"}
    assert torch.equal(second.parameters["weight"], rank1.weight)
    with torch.no_grad():
        want0, want1 = rank0(x), rank1(x)
    assert (want0 - want1).abs().max() > 0.1  # the ranks' results differ: a module holding one rank's would fail
    torch.testing.assert_close(first(x), want0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second(x), want1, rtol=1e-5, atol=1e-5)


def test_weights_inside_the_module_or_another_program_give_another_key(x, tmp_path):
    rank0, rank1 = Shard(16, seed=0), Shard(16, seed=1)  # 4 KiB each: inside the module
    assert rank0.weight.nbytes < inline_limit()
    first = _compile(rank0, x, tmp_path)
    second = _compile(rank1, x, tmp_path)
    assert second.key != first.key and not second.from_cache and second.vmfb != first.vmfb
    assert first.parameters == {} and second.parameters == {}
    assert _holds(first.vmfb, rank0.weight) and not _holds(first.vmfb, rank1.weight)  # each holds its own
    with torch.no_grad():
        torch.testing.assert_close(second(x), rank1(x), rtol=1e-5, atol=1e-5)
    # the same parameters' shapes in another program: another key
    other = _compile(Shard(512, seed=0, activation=torch.tanh), x, tmp_path)
    relu = _compile(Shard(512, seed=0), x, tmp_path)
    assert other.key != relu.key and not other.from_cache
