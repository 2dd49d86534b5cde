"""Boolean masks: data-dependent x[mask] and masked_select, masked assignment."""

from __future__ import annotations

import torch

from fx_rewrites.app.gallery.example import Example


class KeepScoredRows(torch.nn.Module):
    """Keeps the rows whose score is positive, and the positive entries of a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(6, 1)
        self.proj = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = self.score(x)[:, 0] > 0  # rank-1 mask over the rows
        h = self.proj(x)
        return h[keep] * 2, torch.masked_select(h, h > 0)


class ClampNegatives(torch.nn.Module):
    """Masked assignment `y[y < 0] = v` (index_put with a bool index, static shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("floor", torch.tensor(-0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        y[y < 0] = self.floor
        return y


def make_keep_scored_rows() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return KeepScoredRows().eval(), (torch.randn(8, 6),)


def make_clamp_negatives() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return ClampNegatives().eval(), (torch.randn(3, 4),)


EXAMPLES = [
    Example(
        "mask_rows",
        "boolean masks",
        make_keep_scored_rows,
        "h[score > 0] and masked_select: data-dependent sizes ('arith.cmpi' on IREE)",
    ),
    Example("mask_assign", "boolean masks", make_clamp_negatives, "y[y < 0] = v: index_put with a bool index"),
]
