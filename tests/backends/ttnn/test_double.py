"""The ttnn test double keeps ttnn's contract, so the backend tests can catch layout and argument mistakes."""

from __future__ import annotations

import pytest
import torch

from tests.backends.ttnn import reference_ttnn as ttnn

DEV = ttnn.open_device(device_id=0, l1_small_size=32768)


def _dev(t, layout=ttnn.TILE_LAYOUT, dtype=ttnn.bfloat16):
    return ttnn.from_torch(t, dtype=dtype, layout=layout, device=DEV)


def test_tile_layout_pads_to_32_with_poison_and_to_torch_unpads():
    t = _dev(torch.randn(3, 5, 7))
    assert tuple(t._storage.shape) == (3, 32, 32)
    assert torch.isnan(t._storage[:, 5:, :]).all() and torch.isnan(t._storage[:, :, 7:]).all()
    back = ttnn.to_torch(t)
    assert back.shape == (3, 5, 7) and not torch.isnan(back).any()


def test_values_are_rounded_to_bfloat16():
    x = torch.tensor([1.0 + 2**-9, 3.0])
    assert ttnn.to_torch(_dev(x)).tolist() == [1.0, 3.0]
    assert ttnn.to_torch(ttnn.multiply(_dev(x), 1.0 + 2**-9)).tolist() == [1.0, 3.0]


def test_compute_ops_need_tile_layout_on_device():
    with pytest.raises(ttnn.TtnnDoubleError, match="needs TILE layout, got ROW_MAJOR"):
        ttnn.relu(_dev(torch.randn(4), layout=ttnn.ROW_MAJOR_LAYOUT))
    with pytest.raises(ttnn.TtnnDoubleError, match="not on an open device"):
        ttnn.relu(ttnn.from_torch(torch.randn(4), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT))


def test_matmul_checks_inner_dimensions_and_linear_honours_transpose_b():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(ttnn.TtnnDoubleError, match="inner dimensions differ"):
        ttnn.linear(_dev(x), _dev(w))  # torch's [out, in] weight without transpose_b
    out = ttnn.to_torch(ttnn.linear(_dev(x), _dev(w), transpose_b=True)).float()
    torch.testing.assert_close(out, x @ w.T, rtol=3e-2, atol=3e-2)


def test_embedding_wants_uint32_row_major_indices():
    table = _dev(torch.randn(10, 32), layout=ttnn.ROW_MAJOR_LAYOUT)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ttnn.TtnnDoubleError, match="needs ROW_MAJOR layout, got TILE"):
        ttnn.embedding(_dev(ids, dtype=ttnn.uint32), table)
    out = ttnn.embedding(_dev(ids, layout=ttnn.ROW_MAJOR_LAYOUT, dtype=ttnn.uint32), table, layout=ttnn.TILE_LAYOUT)
    assert out.layout is ttnn.TILE_LAYOUT and tuple(out.shape) == (1, 3, 32)


def test_conv2d_rejects_nchw_input():
    x = torch.randn(1, 3, 6, 8)
    w = ttnn.from_torch(torch.randn(4, 3, 3, 3), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT)
    kwargs = dict(weight_tensor=w, device=DEV, in_channels=3, out_channels=4, batch_size=1, input_height=6)
    with pytest.raises(ttnn.TtnnDoubleError, match="is not NHWC"):
        ttnn.conv2d(input_tensor=_dev(x), input_width=8, kernel_size=(3, 3), **kwargs)
    out = ttnn.conv2d(input_tensor=_dev(x.permute(0, 2, 3, 1)), input_width=8, kernel_size=(3, 3), **kwargs)
    assert tuple(out.shape) == (1, 1, 4 * 6, 4)


def test_keywords_ttnn_lacks_are_refused():
    with pytest.raises(TypeError, match="unexpected keyword argument 'eps'"):
        ttnn.layer_norm(_dev(torch.randn(2, 8)), eps=1e-5)  # ttnn spells it epsilon
    with pytest.raises(TypeError, match="positional"):
        ttnn.relu(_dev(torch.randn(4)), None)  # relu's other parameters are keyword-only


def test_front_padding_of_tiles_is_refused_and_row_major_pads():
    x = torch.randn(2, 3)
    with pytest.raises(ttnn.TtnnDoubleError, match="does not support front padding"):
        ttnn.pad(_dev(x), [(1, 0), (0, 0)], 0.0)
    out = ttnn.pad(_dev(x, layout=ttnn.ROW_MAJOR_LAYOUT), [(1, 0), (0, 2)], 0.0)
    assert ttnn.to_torch(out).shape == (3, 5)


def test_attention_mask_must_be_b_heads_s_s():
    q = _dev(torch.randn(2, 3, 5, 8))
    with pytest.raises(ttnn.TtnnDoubleError, match=r"attn_mask of shape \(2, 1, 1, 5\)"):
        ttnn.transformer.scaled_dot_product_attention(q, q, q, attn_mask=_dev(torch.zeros(2, 1, 1, 5)), is_causal=False)
    with pytest.raises(ttnn.TtnnDoubleError, match="is_causal=True"):
        ttnn.transformer.scaled_dot_product_attention(q, q, q, attn_mask=_dev(torch.zeros(2, 1, 5, 5)))
    out = ttnn.transformer.scaled_dot_product_attention(
        q, q, q, attn_mask=_dev(torch.zeros(2, 1, 5, 5)), is_causal=False
    )
    assert tuple(out.shape) == (2, 3, 5, 8)


def test_conv2d_needs_l1_small_and_leaves_a_sharded_output():
    small = ttnn.open_device(device_id=1)  # ttnn's default l1_small_size is 0
    x = ttnn.from_torch(torch.randn(1, 6, 8, 3), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=small)
    w = ttnn.from_torch(torch.randn(4, 3, 3, 3), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT)
    kwargs = dict(weight_tensor=w, in_channels=3, out_channels=4, batch_size=1, input_height=6, input_width=8)
    with pytest.raises(ttnn.TtnnDoubleError, match="L1_SMALL"):
        ttnn.conv2d(input_tensor=x, device=small, kernel_size=(3, 3), **kwargs)
    out = ttnn.conv2d(input_tensor=_dev(torch.randn(1, 6, 8, 3)), device=DEV, kernel_size=(3, 3), **kwargs)
    assert out.is_sharded()
    with pytest.raises(ttnn.TtnnDoubleError, match="sharded"):
        ttnn.relu(out)
    assert not ttnn.relu(ttnn.sharded_to_interleaved(out, ttnn.DRAM_MEMORY_CONFIG)).is_sharded()
