"""IREE's FX importer as the backend drives it: every constant tensor is imported as its own literal."""

from __future__ import annotations

import gc
import re
import weakref

import torch

from fx_rewrites.backends.iree import IreeBackend
from fx_rewrites.backends.iree.cache import CompileCache
from fx_rewrites.backends.iree.importing import import_mlir, iree_modules, pinning_ref_tracker
from fx_rewrites.backends.iree.preparing import prepare_program

N_MASKS = 48


class Masks(torch.nn.Module):
    """Different boolean masks of one shape, kept as buffers (as GPT-Neo keeps its causal and local masks)."""

    def __init__(self, n: int = N_MASKS) -> None:
        super().__init__()
        for i in range(n):
            mask = torch.rand(8, 8, generator=torch.Generator().manual_seed(i)) > 0.5
            self.register_buffer(f"mask{i}", mask, persistent=False)
        self.n = n

    def masks(self) -> list[torch.Tensor]:
        return [getattr(self, f"mask{i}") for i in range(self.n)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.where(mask, x, 0.0) for mask in self.masks()])


def _literals(mlir: str, shape: str) -> list[torch.Tensor]:
    """The uint8 resource literals of `shape` ("8x8"), in the order the module reads them."""
    names = re.findall(rf"torch\.vtensor\.literal\(dense_resource<([\w.]+)> : tensor<{shape}xui8>\)", mlir)
    blobs = dict(re.findall(r'^\s*([\w.]+): "0x([0-9A-F]+)"', mlir, re.MULTILINE))
    # a blob is its 4-byte alignment, then the bytes
    return [torch.tensor(list(bytes.fromhex(blobs[name][8:])), dtype=torch.uint8) for name in names]


def test_each_bool_constant_is_imported_as_its_own_literal():
    # The importer turns each bool constant into a temporary `t.to(torch.uint8)` and caches literals by id();
    # without pinning, a freed temporary's id can be reused and a later mask silently gets an earlier one's
    # values. Whether that happens depends on the allocator (a script importing 32 such masks got 26-31
    # distinct literals; this test without the fix failed 1 of 4 runs): the tracker test below is the
    # deterministic one.
    model = Masks()
    prepared, _ = prepare_program(torch.export.export(model, (torch.randn(8, 8),)))
    literals = _literals(import_mlir(iree_modules(), prepared), "8x8")
    assert len(literals) == N_MASKS
    for i, (literal, mask) in enumerate(zip(literals, model.masks(), strict=True)):
        assert torch.equal(literal.view(8, 8).bool(), mask), f"mask{i} was imported with another constant's values"


def test_many_bool_constants_match_eager_on_iree():
    model = Masks()
    compiled = IreeBackend(cache=CompileCache()).compile(
        torch.export.export(model, (torch.randn(8, 8),)), (torch.randn(8, 8),)
    )
    for seed in (0, 1):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


def test_the_tracker_keeps_what_it_tracked_alive():
    # The deterministic form of the first test: IREE's own tracker lets this tensor die (its id free for the
    # next temporary); the backend's keeps it until the import is dropped.
    fx_importer = iree_modules().compiler.extras.fx_importer
    tracker = pinning_ref_tracker(fx_importer)
    temporary = torch.zeros(2, dtype=torch.uint8)
    alive = weakref.ref(temporary)
    tracker.track(temporary)
    del temporary
    gc.collect()
    assert alive() is not None
