"""Family 8: composites that lie about their schema (to, reshape, batch_norm, rrelu, dropout)."""
import torch, torch.nn.functional as F
from harness import *
begin("out/fam8.txt")

class To(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float64).sum() + x.to("cpu").sum() + x.to(x).sum()

class Reshape(torch.nn.Module):
    def forward(self, x):
        return x.t().reshape(-1) + x.reshape(6)   # non-contig reshape (copy) + contiguous reshape (view)

class BN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(3)
    def forward(self, x):
        return self.bn(x)

class FBN(torch.nn.Module):   # functional batch_norm, eval semantics
    def __init__(self):
        super().__init__()
        self.register_buffer("rm", torch.zeros(3)); self.register_buffer("rv", torch.ones(3))
    def forward(self, x):
        return F.batch_norm(x, self.rm, self.rv, training=False)

class RReLU(torch.nn.Module):
    def forward(self, x):
        return F.rrelu(x, training=self.training)

class Dropout(torch.nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=self.training)

x4 = torch.randn(2, 3, 4, 4)
for title, m, args in [
    ("x.to(float64) / x.to('cpu') / x.to(x)", To(), (torch.randn(2, 3),)),
    ("reshape (copying + viewing)", Reshape(), (torch.randn(2, 3),)),
    ("nn.BatchNorm2d eval", BN().eval(), (x4,)),
    ("nn.BatchNorm2d train", BN().train(), (x4,)),
    ("F.batch_norm(training=False) with buffers", FBN(), (x4,)),
    ("F.rrelu eval", RReLU().eval(), (torch.randn(2, 3),)),
    ("F.rrelu train", RReLU().train(), (torch.randn(2, 3),)),
    ("F.dropout eval", Dropout().eval(), (torch.randn(2, 3),)),
    ("F.dropout train", Dropout().train(), (torch.randn(2, 3),)),
]:
    p(f"\n{'=' * 70}\n## {title}\n{'=' * 70}")
    ep = r1(m, args)
    r2(ep)
    r3(m, args, dynamic=False)
    r3(m, args, dynamic=False, no_grad=True, label="(under torch.no_grad)")
    r3(m, args, dynamic=True, no_grad=True, label="(under torch.no_grad)")
    r4(*r4_fn(m, args))
    r4(*r4_fn(m, args), pre_dispatch=True)
end()
