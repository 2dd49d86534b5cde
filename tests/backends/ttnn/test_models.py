"""Every gallery and zoo model lowers for ttnn, and the result runs on the test double close to eager.

Every output element within rtol = atol = 3e-2 of eager (the backend's
bfloat16 tolerance), except where the model itself cannot be
(`BFLOAT16_LIMITED`: the zoo's MobileNetV2, whose random weights amplify a
relative change of its input about 18 times, see docs/ttnn.md): there the
test checks that rounding only the model's input to bfloat16, in eager
float32, already misses 3e-2 (so no bfloat16 device can meet it, and the
miss is the model's, not the lowering's), that the lowered model's largest
difference stays within 15% of the largest eager output, and that 3e-2 is
still missed, so a change shows here. Nothing is compiled for IREE.
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
#: models whose eager output moves beyond 3e-2 when only their input is rounded to bfloat16 (docs/ttnn.md)
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
    assert not _within_after_rounding_the_input(module, args, kwargs, expected), (
        f"eager {name} stays within {TOL} when its input is rounded to bfloat16: the miss is the lowering's"
    )
    for g, e in pairs:
        scale = max(e.abs().max().item(), 1e-6)
        assert (g - e).abs().max().item() <= RELATIVE * scale, f"max abs diff {(g - e).abs().max().item():.3g}"


def _within_after_rounding_the_input(module, args, kwargs, expected) -> bool:
    """Eager float32 on the inputs rounded to bfloat16 (what from_torch does, and nothing else) is within
    rtol = atol = 3e-2 of eager on the inputs as given."""

    def rounded(t):
        is_float = isinstance(t, torch.Tensor) and t.is_floating_point()
        return t.to(torch.bfloat16).to(t.dtype) if is_float else t

    with torch.no_grad():
        got = module(*pytree.tree_map(rounded, args), **pytree.tree_map(rounded, kwargs))
    return all(
        torch.allclose(g.float(), e.float(), rtol=TOL, atol=TOL)
        for g, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected))
        if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel()
    )


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
