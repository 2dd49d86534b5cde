"""Shared fixtures: small real exports used across the engine tests."""

from __future__ import annotations

import pytest
import torch

from rewrites import testing as rt


class ReluChain(torch.nn.Module):
    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = torch.relu(x)
        return x


class AddRelu(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + w) * 2


@pytest.fixture
def relu_chain_ep() -> torch.export.ExportedProgram:
    return rt.export(ReluChain(16), torch.randn(4, 5))


@pytest.fixture
def add_relu_ep() -> torch.export.ExportedProgram:
    return rt.export(AddRelu(), torch.randn(3, 4), torch.randn(3, 4))
