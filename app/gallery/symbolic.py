"""SymInts in Tensor slots and pow with a SymInt exponent (seed 001, dynamic shapes)."""

from __future__ import annotations

import torch
from torch.export import Dim

from fx_rewrites.app.gallery.example import Example


class SizeScaled(torch.nn.Module):
    """Scales by the batch size and raises to it: `h * n`, `n - h`, `h // n`, `h ** n`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        n = x.shape[0]
        return h * n + (n - h) + h // n + torch.pow(h, n)


class ItemExponent(torch.nn.Module):
    """An exponent read from a tensor: `x ** k.item()` (an unbacked SymInt)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.pow(self.proj(x), k.item()) * k.item()


def make_size_scaled() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return SizeScaled().eval(), (torch.randn(5, 8),)


def make_item_exponent() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return ItemExponent().eval(), (torch.randn(3, 4), torch.tensor(3))


EXAMPLES = [
    Example(
        "size_scaled",
        "SymInt in tensor slots",
        make_size_scaled,
        "h * x.shape[0], h ** x.shape[0] with the batch dynamic (pow is NaN on IREE for h < 0)",
        dynamic_shapes=({0: Dim("batch", min=2, max=64)},),
    ),
    Example(
        "item_exponent",
        "SymInt in tensor slots",
        make_item_exponent,
        "x ** k.item() and x * k.item(): an unbacked SymInt exponent",
    ),
]
