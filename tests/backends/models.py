"""Small models shared by the backend tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class WeightSizes(torch.nn.Module):
    """A weight over the IREE inline limit (a parameter) beside small ones (inline)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(256, 256)  # 256 KiB weight: a parameter
        self.small = torch.nn.Linear(256, 4)  # 4 KiB: inline
        self.register_buffer("scale", torch.full((256,), 0.5))  # 1 KiB buffer: inline

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.relu(self.big(x)) * self.scale)


class PoolNet(torch.nn.Module):
    """Functional pooling: aten.max_pool2d_with_indices / avg_pool2d with stride missing."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return F.avg_pool2d(x, 2, ceil_mode=True).flatten(1)
