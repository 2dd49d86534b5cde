"""Seed 001 exact error + dynamo graph with SymInt placeholders; _check_is_size forms."""
import torch, traceback
from harness import *
begin("out/fam3b.txt")

class MulShape(torch.nn.Module):
    def forward(self, x):
        return x * x.shape[0]

def be(gm, example_inputs):
    p("-- dynamo graph received by a plain backend:")
    dump_gm(gm)
    for inp in example_inputs:
        torch.ops.aten.clone(inp)
    return gm.forward

torch._dynamo.reset()
try:
    torch.compile(MulShape(), backend=be, dynamic=True)(torch.randn(4, 3))
except Exception as e:
    p("ERROR TEXT:\n" + str(e))

class CheckSize(torch.nn.Module):
    def forward(self, x, n):
        k = n.item()
        torch._check_is_size(k)
        torch._check(k < 10)
        return x[:k]

class Nonzero(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x)

ep = r1(CheckSize(), (torch.randn(16), torch.tensor(3)))
r2(ep)
torch._dynamo.config.capture_scalar_outputs = True
r3(CheckSize(), (torch.randn(16), torch.tensor(3)), dynamic=True)
ep = r1(Nonzero(), (torch.randn(4, 3),))
r2(ep)
end()
