"""torch.cond: data-dependent and shape-dependent branches (seed 002)."""

from __future__ import annotations

import torch
from torch.export import Dim

from fx_rewrites.app.gallery.example import Example


class GatedBlock(torch.nn.Module):
    """Picks a branch on the sign of a projection; one branch nests another cond."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)

        def positive(h: torch.Tensor) -> torch.Tensor:
            return torch.cond(h.amax() > 1.0, lambda h: torch.tanh(h) * self.scale, lambda h: h * 0.5, (h,))

        def negative(h: torch.Tensor) -> torch.Tensor:
            return torch.relu(h) - h.mean()

        return torch.cond(h.sum() > 0, positive, negative, (h,))


class BatchSizeSwitch(torch.nn.Module):
    """Large batches take a cheaper path: a predicate on a dynamic dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.shape[0] > 4, lambda x: self.lin(x).relu(), lambda x: self.lin(x).sigmoid(), (x,))


def make_gated_block() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return GatedBlock().eval(), (torch.randn(3, 4),)


def make_batch_size_switch() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return BatchSizeSwitch().eval(), (torch.randn(6, 3),)


EXAMPLES = [
    Example("cond_gated", "torch.cond", make_gated_block, "nested torch.cond on tensor predicates"),
    Example(
        "cond_batch_size",
        "torch.cond",
        make_batch_size_switch,
        "torch.cond on x.shape[0] > 4, batch dynamic",
        dynamic_shapes=({0: Dim("batch", min=2, max=64)},),
    ),
]
