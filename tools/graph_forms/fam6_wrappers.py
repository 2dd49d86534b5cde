"""Family 6: training-IR wrappers (no_grad / autocast in forward), _assert_tensor_metadata."""
import torch
from harness import *
begin("out/fam6.txt")

class NoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
    def forward(self, x):
        with torch.no_grad():
            y = self.lin(x)
        return y.sin()

class NoGradNoParams(torch.nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = x * 2
        return y + 1

class EnableGrad(torch.nn.Module):
    def forward(self, x):
        with torch.enable_grad():
            y = x * 2
        return y + 1

class Autocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
        return y.float()

class ToDtype(torch.nn.Module):  # x.to(dtype) -> _assert_tensor_metadata in training IR
    def forward(self, x):
        return x.to(torch.float16) + 1

class SetGradEnabled(torch.nn.Module):
    def forward(self, x):
        torch._C._set_grad_enabled(False)
        y = x * 2
        torch._C._set_grad_enabled(True)
        return y

x = torch.randn(2, 3)
all_routes("with torch.no_grad(): lin(x)", NoGrad(), (x,))
all_routes("with torch.no_grad(): x*2 (no params)", NoGradNoParams(), (x,))
all_routes("with torch.enable_grad(): x*2", EnableGrad(), (x,))
all_routes("with torch.autocast('cpu', bfloat16): lin(x)", Autocast(), (x,))
all_routes("x.to(torch.float16) + 1", ToDtype(), (x,))
all_routes("torch._C._set_grad_enabled(False) ... (True)", SetGradEnabled(), (x,))
p("\n\n## export under outer torch.no_grad()  (NoGrad module)")
with torch.no_grad():
    ep = r1(NoGrad(), (x,))
    r2(ep)
p("\n\n## R3 under outer torch.no_grad()")
r3(NoGrad(), (x,), no_grad=True)
r3(Autocast(), (x,), no_grad=True)
end()
