"""benchmarks/resnet50_dispatches.py: dispatch names grouped by kind, convolutions labelled by class."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from resnet50_dispatches import conv_label, kind


def test_dispatches_grouped_by_kind():
    assert kind("dispatch_10_mmt4d_8x392x576x8x8x1_f32") == "mmt4d"
    assert kind("dispatch_6_batch_mmt4d_1x8x392x64x8x8x1_f32") == "batch_mmt4d"
    assert kind("dispatch_9_generic_56x56x3x3x64_f32_pack") == "pack"
    assert kind("dispatch_304_unpack_elementwise_1x256x196_f32_pack") == "unpack"
    assert kind("dispatch_4_conv_64x56x56x3x3_f32") == "conv"
    assert kind("dispatch_119_slow_memcpy") == "other"


def test_convolutions_labelled_by_class():
    assert conv_label(torch.nn.Conv2d(128, 128, 3, stride=2, padding=1)) == "conv 3x3/2 128->128"
    assert conv_label(torch.nn.Conv2d(256, 64, 1)) == "conv 1x1 256->64"
