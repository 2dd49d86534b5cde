"""Small modules for the ttnn tests, one per lowering family, with their inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def seeded(module: torch.nn.Module) -> torch.nn.Module:
    return module.eval()


class Elementwise(torch.nn.Module):
    def forward(self, x, y):
        a = torch.relu(x) + y * 2.0 - torch.sigmoid(y) / 3.0
        return torch.maximum(F.gelu(a), torch.exp(-x.abs())) ** 2


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(48, 40), torch.nn.Linear(40, 8)
        self.ln = torch.nn.LayerNorm(40)

    def forward(self, x):
        return torch.softmax(self.fc2(F.silu(self.ln(self.fc1(x)))), -1)


class Attention(torch.nn.Module):
    """Embedding, reshape/permute/transpose, matmul, softmax, concat, reductions."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 32)
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, ids):
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(2, 5, 3, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
        scores = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        out = (scores @ v).transpose(1, 2).reshape(2, 5, 32)
        return torch.cat([out, h], dim=-1).mean(1), out.amax(-1)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.conv1d = torch.nn.Conv1d(8, 6, 3, stride=2, padding=1)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        signal = self.conv1d(x.flatten(2))  # [N, C, L]
        return F.adaptive_avg_pool2d(self.conv2(x), 1).flatten(1), signal


class HostInTheMiddle(torch.nn.Module):
    """i0 has no ttnn lowering: device, host, device."""

    def forward(self, x):
        return torch.relu(torch.special.i0(x * 2.0)) + 1.0


class Misc(torch.nn.Module):
    """batch_norm, clamp, leaky_relu, comparisons and where, slices, casts, attention."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bn = torch.nn.BatchNorm2d(4)
        self.bn.running_mean.uniform_(-1, 1)
        self.bn.running_var.uniform_(0.5, 2)

    def forward(self, img, x, mask):
        y = F.hardtanh(self.bn(img)) + F.leaky_relu(img, 0.2)
        z = torch.where(x > 0.5, x, x * 0.1)[..., 1:7]  # a slice of a device value
        head = x[..., :8].to(torch.float16).float()  # a slice of a host input, read on the device
        att = F.scaled_dot_product_attention(z, z, head[..., :6], attn_mask=mask)
        wide = (att[:, :1] * 2.0).expand(2, 3, 6, 6)  # expand of a device value
        padded = F.pad(y, (1, 2, 0, 3), value=0.5)[:, 1]  # constant pad (W then H), select
        return y.clamp(min=-0.5), att + wide, torch.eq(x, 0.0).float().sum(-1), padded, att[0, 0].T


CASES = {
    "elementwise": (Elementwise, lambda: (torch.randn(4, 40), torch.randn(4, 40))),
    "mlp": (Mlp, lambda: (torch.randn(3, 48),)),
    "attention": (Attention, lambda: (torch.randint(0, 50, (2, 5)),)),
    "convnet": (ConvNet, lambda: (torch.randn(2, 3, 16, 24),)),
    "host_in_the_middle": (HostInTheMiddle, lambda: (torch.randn(2, 40),)),
    "misc": (Misc, lambda: (torch.randn(2, 4, 6, 10), torch.randn(2, 3, 6, 12), torch.randn(2, 1, 6, 6))),
}
