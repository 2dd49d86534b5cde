"""In-place ops and mutation: buffers and inputs updated in forward (seed 003)."""

from __future__ import annotations

import torch

from fx_rewrites.app.gallery.example import Example


class RunningStats(torch.nn.Module):
    """Counts calls in a buffer, keeps a window of the last inputs, scales in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))
        self.register_buffer("window", torch.zeros(4, 3))
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.window[:2].copy_(x)
        y = torch.relu(self.proj(x))
        y.mul_(2)
        with torch.no_grad():
            y.add_(self.window[:2])
        return y * self.calls


def make_running_stats() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return RunningStats().eval(), (torch.randn(2, 3),)


EXAMPLES = [
    Example("running_stats", "in-place / mutation", make_running_stats, "buffer add_, copy_ into a slice, mul_"),
]
