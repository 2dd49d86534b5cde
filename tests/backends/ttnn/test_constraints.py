"""ttnn's documented constraints, kept by the backend and enforced by the double.

Each test runs a model that meets the constraint on the double, then breaks the
backend the way it was broken before (the naive lowering or call) and checks
that the double refuses it with ttnn's own complaint.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.ttnn import dispatch, lower, runtime
from fx_rewrites.backends.ttnn.rules import movement, nn, ops
from fx_rewrites.backends.ttnn.rules.boundary import device_value
from tests.backends.ttnn import reference_ttnn
from tests.backends.ttnn.conftest import assert_close_bf16


@pytest.fixture
def double():
    previous = runtime.use(reference_ttnn)
    runtime.forget_devices()
    yield reference_ttnn
    runtime.use(previous)
    runtime.forget_devices()


def _run(model, *args):
    fn = backends.get("ttnn").compile(lower(rt.export(model, *args)), args)
    with torch.no_grad():
        return fn(*args), model(*args)


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return F.max_pool2d(self.conv(x), 2)


def test_conv_and_pool_need_l1_small(double, monkeypatch):
    x = torch.randn(1, 3, 10, 10)
    assert_close_bf16(*_run(Conv().eval(), x))
    monkeypatch.setattr(runtime, "L1_SMALL_SIZE", 0)  # ttnn's default
    runtime.forget_devices()
    with pytest.raises(reference_ttnn.TtnnDoubleError, match=r"conv2d: Out of Memory.*L1_SMALL"):
        _run(Conv().eval(), x)


def test_conv_and_pool_outputs_are_made_interleaved(double, monkeypatch):
    x = torch.randn(1, 3, 10, 10)
    monkeypatch.setattr(dispatch, "interleaved", lambda ttnn, t: t)
    with pytest.raises(reference_ttnn.TtnnDoubleError, match=r"got a sharded tensor.*sharded_to_interleaved"):
        _run(Conv().eval(), x)


class FrontPad(torch.nn.Module):
    def forward(self, x):
        return F.pad(torch.relu(x), (1, 2, 3, 0), value=0.5) * 2.0


def test_front_padding_goes_through_row_major(double, monkeypatch):
    x = torch.randn(2, 5, 7)
    assert_close_bf16(*_run(FrontPad(), x))

    def naive(rw, x, pad, value):
        return rw.call(ops.pad, x, pad, value)

    monkeypatch.setattr(movement, "pad_tiles", naive)
    with pytest.raises(reference_ttnn.TtnnDoubleError, match="tile padding does not support front padding"):
        _run(FrontPad(), x)


class MaskedAttention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 6), (5, 6), (1, 3, 5, 6)], ids=["hf_padding", "rank2", "full"])
def test_attention_mask_is_expanded_to_b_heads_s_s(double, monkeypatch, mask_shape):
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    mask = torch.randn(mask_shape)
    assert_close_bf16(*_run(MaskedAttention(), q, k, v, mask))
    if mask_shape == (1, 3, 5, 6):
        return  # already in ttnn's shape: nothing to break
    monkeypatch.setattr(nn, "_attention_mask", lambda rw, mask, query, key: device_value(rw, mask))
    with pytest.raises(reference_ttnn.TtnnDoubleError, match=r"attn_mask of shape .* ttnn takes \[b x nqh x s x s\]"):
        _run(MaskedAttention(), q, k, v, mask)


class SmallEmbedding(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, width)

    def forward(self, ids):
        return self.emb(ids) * 2.0


@pytest.mark.parametrize("width", [8, 64])
def test_embedding_tiles_only_widths_of_whole_tiles(double, monkeypatch, width):
    ids = torch.randint(0, 20, (2, 5))
    assert_close_bf16(*_run(SmallEmbedding(width).eval(), ids))
    monkeypatch.setattr(dispatch, "TILE_WIDTH", 1)  # always ask for TILE output, as before
    if width % 32:
        with pytest.raises(reference_ttnn.TtnnDoubleError, match="must be divisible by tile width"):
            _run(SmallEmbedding(width).eval(), ids)
    else:
        assert_close_bf16(*_run(SmallEmbedding(width).eval(), ids))


def test_linear_bias_is_a_row_vector(double, monkeypatch):
    model, x = torch.nn.Linear(8, 6).eval(), torch.randn(3, 8)
    assert_close_bf16(*_run(model, x))
    monkeypatch.setattr(nn, "row_bias", lambda rw, bias: device_value(rw, bias))
    with pytest.raises(reference_ttnn.TtnnDoubleError, match=r"bias of shape \(6,\); ttnn.linear takes a row vector"):
        _run(model, x)


def test_a_full_addmm_addend_is_added_after_the_matmul(double):
    class FullAddend(torch.nn.Module):
        def forward(self, c, a, b):
            return torch.addmm(c, a, b)

    args = (torch.randn(3, 5), torch.randn(3, 4), torch.randn(4, 5))
    assert_close_bf16(*_run(FullAddend(), *args))
