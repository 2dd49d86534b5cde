"""Family 4: boolean mask indexing (data-dependent shapes)."""
import torch
from harness import *
begin("out/fam4.txt")
torch._dynamo.config.capture_scalar_outputs = True
torch._dynamo.config.capture_dynamic_output_shape_ops = True

class Mask1(torch.nn.Module):
    def forward(self, x):
        return x[x > 0]            # rank-1 mask on rank-1 x

class Mask2(torch.nn.Module):
    def forward(self, x):
        return x[x > 0]            # rank-2 mask on rank-2 x

class MaskRows(torch.nn.Module):
    def forward(self, x, m):
        return x[m]                # rank-1 mask over rows of rank-2 x

class MaskedSelect(torch.nn.Module):
    def forward(self, x):
        return torch.masked_select(x, x > 0)

class MaskAssign(torch.nn.Module):
    def forward(self, x, v):
        x = x.clone()
        x[x > 0] = v               # v is a 0-d tensor
        return x

class MaskAssignScalar(torch.nn.Module):
    def forward(self, x):
        y = x.clone()
        y[y > 0] = 0.5
        return y

all_routes("x[x > 0] rank-1", Mask1(), (torch.randn(8),))
all_routes("x[x > 0] rank-2", Mask2(), (torch.randn(4, 3),))
all_routes("x[m] rank-1 bool mask over rows", MaskRows(), (torch.randn(4, 3), torch.tensor([True, False, True, True])))
all_routes("masked_select(x, x > 0)", MaskedSelect(), (torch.randn(4, 3),))
all_routes("x[x > 0] = v (0-d tensor)", MaskAssign(), (torch.randn(4, 3), torch.tensor(1.0)))
all_routes("y[y > 0] = 0.5", MaskAssignScalar(), (torch.randn(4, 3),))
p("\n\n## capture_dynamic_output_shape_ops=False (default) for x[x>0] rank-2")
torch._dynamo.config.capture_dynamic_output_shape_ops = False
r3(Mask2(), (torch.randn(4, 3),), dynamic=False)
end()
