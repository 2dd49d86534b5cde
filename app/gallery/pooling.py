"""Pooling defaults: functional pooling leaves stride empty (seed 000)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fx_rewrites.app.gallery.example import Example


class FunctionalPoolNet(torch.nn.Module):
    """A conv stack that pools with F.max_pool2d(x, 2) and F.avg_pool2d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = F.avg_pool2d(torch.relu(self.conv2(x)), 2, ceil_mode=True)
        return F.max_pool2d(x, 3, padding=1).flatten(1)


class Pool3dNet(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool3d(x, 2, ceil_mode=True) + F.max_pool3d(x, 2, ceil_mode=True)


def make_functional_pool() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return FunctionalPoolNet().eval(), (torch.randn(2, 3, 16, 16),)


def make_pool3d() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return Pool3dNet().eval(), (torch.randn(1, 2, 5, 5, 5),)


EXAMPLES = [
    Example("functional_pool2d", "pooling defaults", make_functional_pool, "F.max_pool2d(x, 2): stride absent"),
    Example("pool3d_ceil", "pooling defaults", make_pool3d, "F.avg_pool3d(x, 2, ceil_mode=True): stride []"),
]
