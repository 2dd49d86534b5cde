"""Family 5: torch.cond."""
import torch
from torch.export import Dim
from harness import *
begin("out/fam5.txt")

class CondTensor(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))

class CondShape(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.shape[0] > 4, lambda x: x.sin(), lambda x: x.cos(), (x,))

class CondBool(torch.nn.Module):
    def forward(self, x):
        return torch.cond(True, lambda x: x.sin(), lambda x: x.cos(), (x,))

class CondNested(torch.nn.Module):
    def forward(self, x, y):
        def t(x, y):
            return torch.cond(y.sum() > 0, lambda x, y: x + y, lambda x, y: x - y, (x, y))
        return torch.cond(x.sum() > 0, t, lambda x, y: x * y, (x, y))

class CondClosure(torch.nn.Module):  # branch closes over a parameter / buffer
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("b", torch.ones(3))
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x * self.w, lambda x: x + self.b, (x,))

x = torch.randn(6, 3)
for title, m, args, ds in [
    ("cond(x.sum() > 0, sin, cos, (x,))", CondTensor(), (x,), {"x": {0: Dim("B", min=2, max=64)}}),
    ("cond(x.shape[0] > 4, ...)", CondShape(), (x,), {"x": {0: Dim("B", min=2, max=64)}}),
    ("cond(True, ...)", CondBool(), (x,), None),
    ("nested cond", CondNested(), (x, torch.randn(6, 3)), None),
    ("cond closing over param/buffer", CondClosure(), (x,), None),
]:
    p(f"\n{'=' * 70}\n## {title}\n{'=' * 70}")
    ep = r1(m, args)
    r2(ep)
    if ds:
        ep = r1(m, args, dynamic_shapes=ds)
        r2(ep)
    r3(m, args, dynamic=False)
    r3(m, args, dynamic=True)
    r4(*r4_fn(m, args))
    r4(*r4_fn(m, args), pre_dispatch=True)
end()
