"""Training-IR wrappers: no_grad and autocast blocks in forward (seed 003)."""

from __future__ import annotations

import torch

from fx_rewrites.app.gallery.example import Example


class NoGradUpdate(torch.nn.Module):
    """A no_grad block that computes with weights and mutates a tensor made outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.gate = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with torch.no_grad():
            g = torch.sigmoid(self.gate(x))
            y.mul_(g)
        return y + g


class AutocastMLP(torch.nn.Module):
    """A bfloat16 autocast region around two linears, cast back to float32.

    Bias-free: a bf16 `addmm` rounds once in torch but twice (after the
    matmul and after the bias add) on IREE, one bf16 ulp apart, more than
    the demo's tolerance."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, bias=False)
        self.fc2 = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc2(torch.relu(self.fc1(x)))
        return h.float().softmax(-1)


def make_no_grad_update() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return NoGradUpdate().eval(), (torch.randn(4, 3),)


def make_autocast_mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return AutocastMLP().eval(), (torch.randn(2, 8),)


EXAMPLES = [
    Example("no_grad_update", "training-IR wrappers", make_no_grad_update, "no_grad block mutating y.mul_(g)"),
    Example("autocast_mlp", "training-IR wrappers", make_autocast_mlp, "torch.autocast(cpu, bfloat16) block"),
]
