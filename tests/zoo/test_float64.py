"""Float noise told from faults (tests/zoo/float64.py): a float32 result not close to eager passes only when
it is no further from the float64 result than FLOAT64_K x torch's own float32 error (over the input and its
neighbours within an ulp)."""

from __future__ import annotations

import pytest
import torch

from tests.zoo.float64 import FLOAT64_K, PERTURBATIONS, float64_outputs, neighbour, reference
from tests.zoo.spec import assert_matches


class Cancel(torch.nn.Module):
    """(a + b) - b with |b| >> |a|: float32 loses a's low bits, ~eps x |b| (6e-5 here), past the zoo's atol."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a + b) - b + torch.zeros(a.shape)  # a tensor the model makes itself takes the default dtype


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(256, generator=g) * 0.1, torch.full((256,), 1000.0) + torch.rand(256, generator=g)


def test_float64_outputs_runs_the_model_in_float64_and_leaves_it_as_it_was():
    model = Cancel()
    a, b = _inputs(0)
    out = float64_outputs(model, (a, b))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, a.double(), rtol=0, atol=1e-12)  # float64 keeps a's bits
    assert torch.get_default_dtype() == torch.float32
    assert model(a, b).dtype == torch.float32


@pytest.mark.parametrize("seed", [0, 1])
def test_a_float32_order_closer_to_float64_than_eager_is_noise(seed):
    """a + (b - b): another float32 order of the same sum, exact where eager is not; not close to eager."""
    model = Cancel()
    a, b = _inputs(seed)
    eager = model(a, b)
    got = a + (b - b)
    with pytest.raises(AssertionError, match="not close"):
        assert_matches(got, eager)  # the tolerance against eager is not widened
    assert_matches(got, eager, exact=lambda: reference(model, (a, b)))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_result_further_from_float64_than_torchs_band_is_a_fault(seed):
    model = Cancel()
    a, b = _inputs(seed)
    eager = model(a, b)
    ref = reference(model, (a, b))
    band = ref.torch_error[0]
    assert band >= (eager.double() - ref.exact[0]).abs().max().item() > 1e-5  # eager's own error, past atol
    got = eager.clone()
    got[7] = ref.exact[0][7].float() + 1.5 * FLOAT64_K * band  # one element off by more than FLOAT64_K x the band
    with pytest.raises(AssertionError, match=r"output 0: .*not close(.|\n)*a fault, not float noise"):
        assert_matches(got, eager, exact=lambda: ref)
    got[7] = ref.exact[0][7].float() + 0.9 * FLOAT64_K * band  # within the band's FLOAT64_K: noise
    assert_matches(got, eager, exact=lambda: ref)


def test_neighbours_move_float32_inputs_by_at_most_an_ulp_and_depend_on_the_draw_only():
    x, ids = torch.randn(64, 8), torch.arange(5)
    moved, same_ids = neighbour((x, ids), 3)
    assert same_ids is ids and moved.dtype == torch.float32
    up, down = torch.nextafter(x, torch.tensor(torch.inf)), torch.nextafter(x, torch.tensor(-torch.inf))
    assert ((moved == x) | (moved == up) | (moved == down)).all()
    assert (moved == up).any() and (moved == down).any() and (moved == x).any()
    assert torch.equal(neighbour((x, ids), 3)[0], moved) and not torch.equal(neighbour((x, ids), 4)[0], moved)
    assert PERTURBATIONS >= 1


def test_without_a_float64_reference_the_mismatch_stands():
    a, b = _inputs(0)
    eager = Cancel()(a, b)

    def unavailable():
        raise RuntimeError("expected scalar type Double but found Float")

    with pytest.raises(AssertionError, match=r"not close(.|\n)*no float64 reference to judge it by: expected scalar"):
        assert_matches(a + (b - b), eager, exact=unavailable)


def test_only_float32_is_judged_against_float64():
    got = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(AssertionError, match="not close"):
        assert_matches(got, got + 1e-6, exact=lambda: got)
