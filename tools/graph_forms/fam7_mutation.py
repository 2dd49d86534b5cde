"""Family 7: in-place / mutation."""
import torch
from harness import *
begin("out/fam7.txt")

class AddInput(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2

class BufferAdd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(3))
    def forward(self, x):
        self.n.add_(1)
        return x + self.n

class IndexPut(torch.nn.Module):
    def forward(self, x, i, v):
        x.index_put_((i,), v)
        return x

class CopyInto(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))
    def forward(self, x):
        self.cache[:2].copy_(x)
        return self.cache.sum(0)

class NoGradOuter(torch.nn.Module):  # seed 003: mutation under no_grad of tensor made outside
    def forward(self, x):
        y = x * 2
        with torch.no_grad():
            y.add_(1)
        return y

class Intermediate(torch.nn.Module):  # in-place on an intermediate
    def forward(self, x):
        y = x.relu()
        y.mul_(3)
        return y

x = torch.randn(2, 3)
all_routes("x.add_(1) on user input", AddInput(), (x,))
all_routes("buffer self.n.add_(1)", BufferAdd(), (torch.randn(3),))
all_routes("x.index_put_((i,), v)", IndexPut(), (torch.randn(4, 3), torch.tensor([0, 2]), torch.randn(2, 3)))
all_routes("self.cache[:2].copy_(x)", CopyInto(), (x,))
all_routes("seed003: y=x*2; with no_grad: y.add_(1)", NoGradOuter(), (x,))
all_routes("y=x.relu(); y.mul_(3)", Intermediate(), (x,))
p("\n## R3 with buffers, under outer torch.no_grad()")
r3(BufferAdd(), (torch.randn(3),), no_grad=True)
r3(CopyInto(), (x,), no_grad=True)
end()
