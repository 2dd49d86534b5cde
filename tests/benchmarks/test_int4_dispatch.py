"""benchmarks/int4_dispatch.py: the int4 words round-trip every value, and the hand-written matvec dispatch spliced
into torch-mlir's import compiles through IREE with its words kept and computes x @ (q * s).T within torch's own
float32 error against float64."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from int4_dispatch import Int4Dispatch, compile_form, pack_scales, pack_words, run_vmfb, splice, unpack  # noqa: E402

from tests.backends.iree.rules.float32_error import assert_within_torch_error  # noqa: E402


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=generator)
    s = torch.rand(n, k // 32, generator=generator) * 0.01 + 1e-3
    return q, s


@pytest.mark.parametrize("tile", [1, 4])
def test_words_and_scales_unpack_to_the_weight(tile):
    q, s = _weights(64, 256, 0)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)  # every value, at every position of a word
    q[1, 8:24] = torch.arange(-8, 8, dtype=torch.int8)
    words, scales = pack_words(q, tile), pack_scales(s, tile)
    assert words.dtype == torch.int32 and words.numel() == 64 * 256 // 8  # eight values a word
    want = (q.view(64, 8, 32).to(torch.float32) * s.unsqueeze(-1)).view(64, 256)
    assert torch.equal(unpack(words, scales, 64, tile), want)


def test_a_word_holds_eight_positions_of_one_channel_low_nibble_first():
    q = torch.zeros(8, 32, dtype=torch.int8)
    q[3, 8:16] = torch.tensor([1, 2, 3, 4, 5, 6, 7, -8], dtype=torch.int8)  # channel 3, word w = 1 of group 0
    words = pack_words(q, 1).view(1, 1, 4, 1, 8)  # [N/8, G, 4, tile, 8]
    assert words[0, 0, 1, 0, 3].item() == 0x87654321 - 2**32
    assert words.count_nonzero().item() == 1


def test_a_weight_off_the_tile_is_refused():
    q, s = _weights(48, 256, 0)
    with pytest.raises(ValueError, match="N a multiple of 32"):
        Int4Dispatch(q, s, tile=4)


@pytest.mark.parametrize(("n", "k", "tile"), [(256, 1024, 4), (32000, 1024, 4), (64, 2816, 1)])
def test_the_kernel_prefetches_each_line_of_a_group_ahead_within_the_words(n, k, tile):
    # the words of a group (32 tile words: 2 tile cache lines) PREFETCH words ahead, the index clamped to the
    # buffer's last group, so no prefetch reads past the words
    from fx_rewrites.backends.iree.int4_dispatch import LINE, PREFETCH, executable

    text = executable(1, n, k, tile, 8)
    nw = n * k // 8
    consts = dict(re.findall(r"(%c\d+w) = arith.constant (\d+) : index", text))
    ahead = re.search(r"%pfa = arith.addi %wbase, (%c\d+w)", text)
    clamp = re.search(r"%pfb = arith.minui %pfa, (%c\d+w)", text)
    lines = [int(consts[c]) for c in re.findall(r"%pf\d+ = arith.addi %pfb, (%c\d+w)", text)]
    assert ahead and int(consts[ahead.group(1)]) == PREFETCH
    assert clamp and int(consts[clamp.group(1)]) == nw - 32 * tile
    assert lines == list(range(0, 32 * tile, LINE))
    assert text.count("memref.prefetch %wm[%pf") == len(lines) == 2 * tile
    assert int(consts[clamp.group(1)]) + max(lines) + LINE <= nw


def test_splice_refuses_a_module_without_the_op():
    with pytest.raises(ValueError, match=r"no fx_rewrites\.int4_matvec"):
        splice("module {\n}")


@pytest.mark.slow  # three IREE compiles
@pytest.mark.parametrize(("rows", "rows_dim"), [(1, False), (3, False), (3, True)])
def test_the_dispatch_computes_the_grouped_matvec_and_keeps_its_words(tmp_path, rows, rows_dim):
    from cpu_isa import backend

    n, k = 256, 1024
    q, s = _weights(n, k, 1)
    module = Int4Dispatch(q, s, tile=4, per=3).eval()  # 8 tiles over 3 workgroups: the last one holds 2
    iree = backend("host")
    vmfb = tmp_path / "dispatch.vmfb"
    compile_form(module, torch.zeros(rows, k), [*iree.flags, *iree.perf_flags], vmfb, rows_dim)
    if rows_dim:
        assert "tensor.dim" in vmfb.with_suffix(".mlir").read_text()  # the row count passed to the dispatch
    deq = (q.view(n, -1, 32).double() * s.double().unsqueeze(-1)).view(n, k)
    inputs = [  # with a Dim: another row count too
        (torch.randn(count, k, generator=torch.Generator().manual_seed(seed)),)
        for seed, count in ((2, rows), (3, 5 if rows_dim else rows))
    ]
    for (x,) in inputs:
        got = run_vmfb(vmfb, x)
        assert got.shape == (x.shape[0], n) and got.dtype == torch.float32
    product = lambda x: x @ deq.float().t()  # torch's float32 product
    exact = lambda x: x.double() @ deq.t()
    # the kernel sums in another order than torch's: within the largest error torch makes at these shapes
    assert_within_torch_error(lambda x: run_vmfb(vmfb, x), product, inputs, exact_of=exact, redraws=16)
    assert_within_torch_error(module, product, inputs, exact_of=exact, redraws=16)  # the eager op
    data = vmfb.read_bytes()
    assert module.words.numpy().tobytes() in data  # the int4 words as they are: half int8's bytes
    assert unpack(module.words, module.scales, n, 4)[0, :64].numpy().tobytes() not in data
