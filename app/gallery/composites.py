"""Composites that lie about their schema: eval batch norm, rrelu, dropout."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fx_rewrites.app.gallery.example import Example


class ConvBnRrelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rrelu(self.bn(self.conv(x)), training=False)
        return F.dropout(y, 0.2, training=False).mean((2, 3))


def make_conv_bn_rrelu() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return ConvBnRrelu().eval(), (torch.randn(2, 3, 8, 8),)


EXAMPLES = [
    Example("conv_bn_rrelu", "schema-lying composites", make_conv_bn_rrelu, "eval BatchNorm, rrelu, dropout"),
]
