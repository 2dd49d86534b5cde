"""Family 2: fresh constants (torch.tensor in forward), seed 000, detach_."""
import torch
from harness import *

begin("out/fam2.txt")

class TensorConst(torch.nn.Module):
    def forward(self, x):
        return x + torch.tensor([1.0, 2.0, 3.0])

class ScalarConst(torch.nn.Module):
    def forward(self, x):
        return x * torch.tensor(2.0)

class BoolConst(torch.nn.Module):
    def forward(self, x):
        return torch.where(torch.tensor(True), x, -x)

class Seed000(torch.nn.Module):  # seed 000: x[y == 1] = 2
    def forward(self, x, y):
        x[y == 1] = 2
        return x

class Seed000Ret(torch.nn.Module):  # functional variant that returns something new
    def forward(self, x, y):
        x = x.clone()
        x[y == 1] = 2
        return x

class Detach_(torch.nn.Module):
    def forward(self, x):
        t = torch.tensor([1.0, 2.0, 3.0])
        t.detach_()
        y = (x * 2).detach_()
        return y + t

class ConstParam(torch.nn.Module):  # plain tensor attribute (not param/buffer)
    def __init__(self):
        super().__init__()
        self.c = torch.ones(3)
    def forward(self, x):
        return x + self.c

x = torch.randn(3)
all_routes("x + torch.tensor([1.,2.,3.])", TensorConst(), (x,))
all_routes("x * torch.tensor(2.0)", ScalarConst(), (x,))
all_routes("torch.where(torch.tensor(True), x, -x)", BoolConst(), (x,))
all_routes("seed000: x[y == 1] = 2 (in place on input)", Seed000(), (torch.randn(3), torch.tensor([1, 0, 1])))
all_routes("x=x.clone(); x[y == 1] = 2", Seed000Ret(), (torch.randn(3), torch.tensor([1, 0, 1])))
all_routes("detach_ (torch.tensor(..).detach_(), (x*2).detach_())", Detach_(), (x,))
all_routes("plain tensor attribute self.c", ConstParam(), (x,))
# strict export for comparison
p("\n\n## STRICT export variants")
r1(TensorConst(), (x,), strict=True)
r1(Seed000(), (torch.randn(3), torch.tensor([1, 0, 1])), strict=True)
end()
