"""torchvision's model code on CPU torch: the Python nms that tests/zoo/torchvision_cpu.py registers."""

from __future__ import annotations

import pytest
import torch

from tests.zoo import torchvision_cpu


@pytest.fixture(scope="module")
def ops():
    torchvision_cpu.install()
    return pytest.importorskip("torchvision.ops")


def test_nms_keeps_the_best_of_each_overlapping_group(ops):
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 9.0], [21, 21, 30, 30]])
    scores = torch.tensor([0.9, 0.8, 0.7, 0.95, 0.6])
    # box 3 (0.95) overlaps 0 (IoU 0.9) and 1 (IoU 72/118 = 0.61); box 2 overlaps 4 (IoU 81/100)
    assert ops.nms(boxes, scores, 0.5).tolist() == [3, 2]
    # at 0.65, box 1 (IoU 0.61 with box 3) stays; box 0 (0.9) is still suppressed
    assert ops.nms(boxes, scores, 0.65).tolist() == [3, 1, 2]
    assert ops.batched_nms(boxes, scores, torch.tensor([0, 1, 0, 0, 1]), 0.5).tolist() == [3, 1, 2, 4]


def test_nms_of_no_boxes(ops):
    assert ops.nms(torch.zeros(0, 4), torch.zeros(0), 0.5).tolist() == []


def test_roi_align_takes_torchvisions_python_path(ops):
    """roi_align needs no compiled op: torchvision's own Python version runs. torchvision wraps it in torch.compile
    (`lazy_compile`): run eagerly here (stance "force_eager"; Inductor's compile of it was ~10 CPU s), dynamo traces
    it in tests/backends/test_dynamo.py's Faster R-CNN."""
    features = torch.arange(16.0).reshape(1, 1, 4, 4)
    boxes = torch.tensor([[0, 0.0, 0.0, 3.0, 3.0]])
    with torch.compiler.set_stance("force_eager"):
        out = ops.roi_align(features, boxes, output_size=1, spatial_scale=1.0, sampling_ratio=1, aligned=False)
    assert out.shape == (1, 1, 1, 1)
    # one sample at the box centre (1.5, 1.5): the mean of 5, 6, 9, 10
    assert out.item() == pytest.approx(7.5)
