"""Which overloads receive a SymInt/SymFloat/SymBool node in a schema slot typed Tensor?
Scans R1(dyn), R2 and R3(dynamic=True) graphs for many expressions."""
import torch
from torch.export import Dim
from harness import *
begin("out/fam3c.txt")

def bad_slots(gm):
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        sch = n.target._schema
        for i, a in enumerate(sch.arguments):
            if a.kwarg_only:
                v = n.kwargs.get(a.name)
            else:
                v = n.args[i] if i < len(n.args) else None
            if isinstance(v, torch.fx.Node) and isinstance(a.type, torch.TensorType):
                val = v.meta.get("val")
                if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
                    out.append(f"{tgt_str(n)} slot {i} '{a.name}: Tensor' <- {v.name} :: {val_str(val)}")
    return out

exprs = {
    "x * n": lambda x: x * x.shape[0],
    "n * x": lambda x: x.shape[0] * x,
    "x + n": lambda x: x + x.shape[0],
    "x - n": lambda x: x - x.shape[0],
    "n - x": lambda x: x.shape[0] - x,
    "x / n": lambda x: x / x.shape[0],
    "n / x": lambda x: x.shape[0] / x,
    "x // n": lambda x: x // x.shape[0],
    "x ** n": lambda x: x ** x.shape[0],
    "n ** x": lambda x: x.shape[0] ** x,
    "x > n": lambda x: x > x.shape[0],
    "x == n": lambda x: x == x.shape[0],
    "torch.where(x>0, x, n)": lambda x: torch.where(x > 0, x, x.shape[0]),
    "x.clamp(max=n)": lambda x: x.clamp(max=x.shape[0]),
    "torch.maximum(x, tensor(n))": lambda x: torch.maximum(x, torch.tensor(x.shape[0])),
    "x.fill_(n) on clone": lambda x: x.clone().fill_(x.shape[0]),
    "x * (n/2) (SymFloat)": lambda x: x * (x.shape[0] / 2),
    "x.mean() * n": lambda x: x.mean() * x.shape[0],
    "arange(n) * x": lambda x: torch.arange(x.shape[0]) * x,
}

class M(torch.nn.Module):
    def __init__(self, f): super().__init__(); self.f = f
    def forward(self, x): return self.f(x)

for name, f in exprs.items():
    m = M(f)
    x = torch.randn(5)
    res = {}
    try:
        ep = torch.export.export(m, (x,), dynamic_shapes={"x": {0: Dim("B", min=2, max=64)}})
        res["R1"] = bad_slots(ep.graph_module)
        res["R2"] = bad_slots(ep.run_decompositions().graph_module)
    except Exception as e:
        res["R1"] = [f"!! {type(e).__name__}: {str(e).splitlines()[0][:150]}"]
    torch._dynamo.reset()
    gms = []
    def fw(gm, ex):
        gms.append(gm); return gm.forward
    try:
        with torch.no_grad():
            torch.compile(m, backend=aot_autograd(fw_compiler=fw), dynamic=True)(x)
        res["R3d"] = [s for g in gms for s in bad_slots(g)]
    except Exception as e:
        res["R3d"] = [f"!! {type(e).__name__}: {str(e).splitlines()[0][:150]}"]
    p(f"\n## {name}")
    for k, v in res.items():
        for s in v or ["(none)"]:
            p(f"  {k:4s} {s}")
end()

# Also: every node that takes a Sym* argument in any slot (to see Scalar overloads chosen)
begin("out/fam3c_any.txt")
def sym_users(gm):
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and "sym_size" not in str(n.target):
            if any(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), (torch.SymInt, torch.SymFloat)) for a in n.args):
                out.append(f"{n.name} = {tgt_str(n)}{arg_str(tuple(n.args))}")
    return out
for name in ["n - x", "n / x", "x ** n", "n ** x", "x > n", "torch.where(x>0, x, n)", "x.clamp(max=n)", "torch.maximum(x, tensor(n))", "x.fill_(n) on clone", "arange(n) * x"]:
    m = M(exprs[name]); x = torch.randn(5)
    ep = torch.export.export(m, (x,), dynamic_shapes={"x": {0: Dim("B", min=2, max=64)}})
    p(f"## {name}\n  R1: " + "; ".join(sym_users(ep.graph_module)) + "\n  R2: " + "; ".join(sym_users(ep.run_decompositions().graph_module)))
    torch._dynamo.reset(); gms = []
    with torch.no_grad():
        torch.compile(m, backend=aot_autograd(fw_compiler=lambda gm, ex: (gms.append(gm), gm.forward)[1]), dynamic=True)(x)
    p("  R3d: " + "; ".join(s for g in gms for s in sym_users(g)))
end()
