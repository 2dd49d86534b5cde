"""Family 3: SymInt where a tensor is expected (dynamic shapes)."""
import torch
from torch.export import Dim
from harness import *

begin("out/fam3.txt")

class MulShape(torch.nn.Module):
    def forward(self, x):
        return x * x.shape[0]

class Full(torch.nn.Module):
    def forward(self, x):
        return torch.full((x.shape[0],), 3.0) + x

class FullValue(torch.nn.Module):  # SymInt as the *fill value*
    def forward(self, x):
        return torch.full((2,), x.shape[0])

class AddSize(torch.nn.Module):
    def forward(self, x, y):
        return x + y.size(0)

class Item(torch.nn.Module):
    def forward(self, x, n):
        k = n.item()
        return torch.zeros(k) , x * k

class Pow(torch.nn.Module):
    def forward(self, x):
        return torch.pow(x, x.shape[0])

class ScalarTensorOfShape(torch.nn.Module):
    def forward(self, x):
        return x / torch.tensor(x.shape[0])

B = Dim("B", min=2, max=64)
x = torch.randn(4, 3)
cases = [
    ("x * x.shape[0]", MulShape(), (x,), {"x": {0: B}}),
    ("torch.full((x.shape[0],), 3.0) + x", Full(), (torch.randn(4),), {"x": {0: B}}),
    ("torch.full((2,), x.shape[0])", FullValue(), (torch.randn(4),), {"x": {0: B}}),
    ("x + y.size(0)", AddSize(), (x, torch.randn(5)), {"x": {0: B}, "y": {0: Dim("N", min=2, max=64)}}),
    ("torch.pow(x, x.shape[0])", Pow(), (x,), {"x": {0: B}}),
    ("x / torch.tensor(x.shape[0])", ScalarTensorOfShape(), (x,), {"x": {0: B}}),
]
for title, m, args, ds in cases:
    p(f"\n{'=' * 70}\n## {title}\n{'=' * 70}")
    ep = r1(m, args, dynamic_shapes=ds)
    r2(ep)
    r3(m, [a.clone() for a in args], dynamic=True)
    r4(lambda *a: m(*a), [a.clone() for a in args])
    r4(lambda *a: m(*a), [a.clone() for a in args], pre_dispatch=True)

# .item(): export (unbacked), compile with and without capture_scalar_outputs
p(f"\n{'=' * 70}\n## n.item() -> zeros(k), x * k\n{'=' * 70}")
m = Item(); args = (torch.randn(4), torch.tensor(3))
ep = r1(m, args, dynamic_shapes={"x": {0: B}, "n": None})
r2(ep)
r3(m, args, dynamic=True, label="(capture_scalar_outputs=False)")
torch._dynamo.config.capture_scalar_outputs = True
r3(m, args, dynamic=True, label="(capture_scalar_outputs=True)")
r3(m, args, dynamic=False, label="static (capture_scalar_outputs=True)")
torch._dynamo.config.capture_scalar_outputs = False
r4(lambda *a: m(*a), list(args))
r4(lambda *a: m(*a), list(args), pre_dispatch=True)

# ---- seed 001: a backend that calls aten.clone on every placeholder / example input
p(f"\n{'=' * 70}\n## seed 001: backend clones every input\n{'=' * 70}")
from torch._dynamo.backends.common import aot_autograd

def make_cloning(kind):
    def be(gm, example_inputs):
        p(f"  [{kind}] example_inputs: {val_str(list(example_inputs))}")
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                p(f"    placeholder {n.name} :: {val_str(n.meta.get('val', n.meta.get('example_value')))}")
        for inp in example_inputs:
            torch.ops.aten.clone(inp)
        return gm.forward
    return be

for kind, backend in [("dynamo graph (plain backend)", make_cloning("dynamo")),
                      ("aot_autograd fw graph", aot_autograd(fw_compiler=make_cloning("aot-fw")))]:
    for dyn in (True, None):
        torch._dynamo.reset()
        p(f"\n### {kind}, dynamic={dyn}")
        with guarded(kind):
            c = torch.compile(MulShape(), backend=backend, dynamic=dyn)
            c(torch.randn(4, 3)); c(torch.randn(5, 3)); c(torch.randn(6, 3))
            p("  ok (no error)")
end()
