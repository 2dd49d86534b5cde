"""The warning (and the error) of a backward graph under torch.compile(backend="fx_rewrites_iree")."""

from __future__ import annotations

import warnings

import pytest
import torch

from fx_rewrites.backends.dynamo import BackwardNotSupported, dynamo_backend


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())


def test_backward_warning_says_what_ran_where_and_what_to_do():
    model = _model()
    compiled = torch.compile(model, backend=dynamo_backend("iree"))
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x).sum().backward()
        compiled(x).sum().backward()
    texts = [str(w.message) for w in caught if "backward" in str(w.message)]
    assert len(texts) == 1, texts  # once per backward graph
    text = texts[0]
    assert "a backward ran" in text and "this backward graph runs on torch eager" in text  # what happened
    assert "ops: " in text and "tanh_backward" in text  # which graph: its size and ops
    assert "forward graph stays on the backend" in text
    assert "torch.no_grad()" in text and "inference" in text  # what to do for inference
    assert "filterwarnings('ignore', 'compiles inference and forward graphs only')" in text  # ... for training
    assert "backward='error'" in text
    reference = _model()
    reference(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, 2 * reference[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_backward_error_names_the_graph_and_the_fix():
    compiled = torch.compile(_model(), backend=dynamo_backend("iree", backward="error"))
    with pytest.raises(BackwardNotSupported) as raised:
        compiled(torch.randn(2, 4)).sum().backward()
    text = str(raised.value)
    assert "this backward graph (" in text and "tanh_backward" in text and "was refused" in text
    assert "torch.no_grad()" in text and "backward='eager'" in text
