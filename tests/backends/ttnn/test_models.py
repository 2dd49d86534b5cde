"""Every gallery and zoo model lowers for ttnn, and the result runs on the test double close to eager.

Every output element within rtol = atol = 3e-2 of eager (the backend's
bfloat16 tolerance), except where bfloat16 through a whole network cannot
(`BFLOAT16_LIMITED`: MobileNetV2, whose lowered graph matches eager exactly
with float32 stand-ins, see docs/ttnn.md): there the largest difference must
stay within 15% of the largest eager output, and the test also checks that
3e-2 is still missed, so a fix shows here. Nothing is compiled for IREE.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from fx_rewrites import backends
from fx_rewrites.app.gallery import gallery
from fx_rewrites.backends.ttnn import lower, runtime
from tests.backends.ttnn import reference_ttnn
from tests.zoo import registry

RELATIVE = 0.15
TOL = 3e-2
#: models bfloat16 keeps beyond 3e-2 of eager (docs/ttnn.md, Numerics)
BFLOAT16_LIMITED = frozenset({"mobilenet_v2"})


@pytest.fixture(autouse=True)
def _double():
    previous = runtime.use(reference_ttnn)
    yield
    runtime.use(previous)


def _check(module, args, kwargs, program, name=""):
    fn = backends.get("ttnn").compile(lower(program), args)  # lowering may leave all on the host (3-D pooling)
    with torch.no_grad():
        got, expected = fn(*args, **kwargs), module(*args, **kwargs)
    pairs = [
        (g.float(), e.float())
        for g, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected))
        if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel()
    ]
    for g, e in pairs:
        assert not g.isnan().any() or e.isnan().any()
    within = all(torch.allclose(g, e, rtol=TOL, atol=TOL) for g, e in pairs)
    if name not in BFLOAT16_LIMITED:
        for g, e in pairs:
            torch.testing.assert_close(g, e, rtol=TOL, atol=TOL)
        return
    assert not within, f"{name} is within {TOL} of eager now: take it out of BFLOAT16_LIMITED"
    for g, e in pairs:
        scale = max(e.abs().max().item(), 1e-6)
        assert (g - e).abs().max().item() <= RELATIVE * scale, f"max abs diff {(g - e).abs().max().item():.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("example", gallery(), ids=lambda e: e.name)
def test_gallery_model_lowers_and_runs(example):
    module, args = example.make()
    program = torch.export.export(module, tuple(args), dynamic_shapes=example.dynamic_shapes)
    _check(module, tuple(args), {}, program)


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.parametrize("entry", [m for m in registry.FIRST if not m.export_error], ids=lambda m: m.name)
def test_zoo_model_lowers_and_runs(entry):
    module = entry.model()
    args, kwargs = entry.inputs(registry.SEEDS[0])
    program = torch.export.export(module, tuple(args), kwargs or None)
    _check(module, tuple(args), kwargs, program, entry.name)
