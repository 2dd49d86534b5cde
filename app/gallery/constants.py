"""Fresh constants: torch.tensor(...) in forward (seed 000)."""

from __future__ import annotations

import torch

from fx_rewrites.app.gallery.example import Example


class TensorLiterals(torch.nn.Module):
    """Literal tensors in forward: lift_fresh_copy + detach_ in the export."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = torch.tensor([0.5, -1.0, 2.0])
        scale = torch.tensor(3.0)
        return self.proj(x + offset) * scale


def make_tensor_literals() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return TensorLiterals().eval(), (torch.randn(4, 3),)


EXAMPLES = [
    Example(
        "tensor_literals", "fresh constants", make_tensor_literals, "torch.tensor in forward: lift_fresh_copy, detach_"
    ),
]
