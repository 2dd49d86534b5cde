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


class PoolNet(torch.nn.Module):
    """Functional pooling: aten.max_pool2d_with_indices / avg_pool2d with stride missing."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return F.avg_pool2d(x, 2, ceil_mode=True).flatten(1)
