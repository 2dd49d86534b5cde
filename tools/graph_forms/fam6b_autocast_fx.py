"""Family 6b: autocast / no_grad without params so make_fx routes run; splice check."""
import torch
from harness import *
begin("out/fam6b.txt")

class AutocastMM(torch.nn.Module):
    def forward(self, x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
        return y.float()

all_routes("autocast: x @ w (w input)", AutocastMM(), (torch.randn(2, 3), torch.randn(3, 3)))

# Does naively splicing the wrap_with_autocast body change dtype?
ep = torch.export.export(AutocastMM(), (torch.randn(2, 3), torch.randn(3, 3)))
body = ep.graph_module.submod_1
x, w = torch.randn(2, 3), torch.randn(3, 3)
p("\n## splice check: body run outside autocast ->", body(x, w)[0].dtype,
  "; via HOP ->", ep.module()(x, w).dtype, "(after .float())")
with torch.autocast("cpu", dtype=torch.bfloat16):
    p("## body run inside autocast ->", body(x, w)[0].dtype)
end()
